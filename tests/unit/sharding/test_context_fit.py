"""The sequence must split into whole chunks over the context axis (`sharding.mesh.
check_context_fit`), and with the blockwise kernel each chunk into whole blocks (`nn.attention.
context_checks.check_layout`), refused before anything compiles."""

from __future__ import annotations

import pytest

from expertax.config import ConfigError
from expertax.nn.attention import context_checks
from expertax.nn.attention.blockwise import DEFAULT_BLOCK
from expertax.preflight import load_config
from expertax.sharding import mesh


def check_context_fit(c, shape: dict[str, int]) -> None:
    """Both checks, in the order `preflight.check_layout` runs them."""
    mesh.check_context_fit(c, shape)
    context_checks.check_layout(c, shape)


def cfg(length: int, impl: str = "blockwise", balanced: bool = True):
    return load_config(
        overrides={
            "model_name": "deepseek3-tiny",
            "max_target_length": length,
            "attention_impl": impl,
            "context_parallel_load_balance": balanced,
        }
    )


def test_a_chunk_of_part_blocks_is_refused_with_the_keys_and_valid_lengths():
    # 6 x 512 tokens over 2 x 2 chunks: 768 tokens each, one and a half blocks
    with pytest.raises(ConfigError) as e:
        check_context_fit(cfg(6 * DEFAULT_BLOCK), {"context": 2})
    words = str(e.value)
    for part in ("max_target_length=3072", "context=2", "attention_impl=blockwise", "2048"):
        assert part in words
    # controls: whole blocks, or a chunk shorter than a block (the block is the chunk), or the
    # dot kernel (no blocks), or no context split, pass
    check_context_fit(cfg(8 * DEFAULT_BLOCK), {"context": 2})
    check_context_fit(cfg(6 * DEFAULT_BLOCK), {"context": 4})  # chunks of 384 tokens
    check_context_fit(cfg(6 * DEFAULT_BLOCK, "dot"), {"context": 2})
    check_context_fit(cfg(6 * DEFAULT_BLOCK), {"context": 1})


def test_without_load_balance_the_chunks_are_per_device():
    check_context_fit(cfg(3 * DEFAULT_BLOCK, balanced=False), {"context": 3})  # 512 each
    with pytest.raises(ConfigError, match="multiple of 1024"):
        check_context_fit(cfg(3 * DEFAULT_BLOCK, balanced=False), {"context": 2})  # 768 each
    with pytest.raises(ConfigError, match="does not split into 4 equal chunks"):
        check_context_fit(cfg(1030), {"context": 2})


def test_the_ring_strategy_needs_mla_with_the_blockwise_kernel():
    """context_parallel_strategy=ring passes MLA's latent through its blockwise kernel: `auto`
    picks that kernel for it; the dot kernel or a GQA model is refused naming the keys."""
    from expertax.nn.attention import context

    ring = {"context_parallel_strategy": "ring", "ici_context_parallelism": 2}
    auto = load_config(overrides={"model_name": "deepseek3-tiny", "attention_impl": "auto", **ring})
    assert context.kernel_impl(auto, auto.max_target_length) == "blockwise"
    for over in ({"model_name": "deepseek3-tiny", "attention_impl": "dot"},
                 {"model_name": "mixtral-tiny"}):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            load_config(overrides={**over, **ring})
        assert "context_parallel_strategy=ring" in str(e.value)
        assert "context_parallel_strategy=all_gather" in str(e.value)


@pytest.mark.parametrize("smaller", ["all_gather", "ring"])
def test_fit_compiles_both_strategies_of_an_mla_context_split_and_keeps_the_smaller(
    smaller, monkeypatch
):
    """The answer of `--fit` that splits an MLA model's sequence is compiled with the other
    context strategy too (the same work; the estimate cannot rank their bytes), and the smaller
    program is the plan: whichever it is."""
    from expertax.planner import fit

    c = load_config(overrides={"model_name": "deepseek3-tiny", "max_target_length": 4096,
                               "per_device_batch_size": 0.5})  # fmt: skip
    seen = []
    every = fit.candidates  # the search's own candidates, its context splits only
    monkeypatch.setattr(fit, "candidates", lambda *a, **k: [
        x for x in every(*a, **k) if x.overrides["ici_context_parallelism"] > 1])  # fmt: skip

    def compile_fn(cc, hbm):
        seen.append((cc.ici_context_parallelism, cc.context_parallel_strategy))
        return 1000 if cc.context_parallel_strategy == smaller else 2000

    r = fit.fit_search(c, 8, 1.0, headroom=0.0, max_compiles=1, compile_fn=compile_fn,
                       offload=False)  # fmt: skip
    best = r["best"]["overrides"]
    assert r["fits"] and best["ici_context_parallelism"] > 1, seen
    # the search's own answer is the ring (space.ring_context); its sibling compiled last
    assert seen[-1] == (best["ici_context_parallelism"], "all_gather"), seen
    assert best["context_parallel_strategy"] == smaller
    assert r["best"]["peak_device_bytes"] == 1000
