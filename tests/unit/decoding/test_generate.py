"""Decoding with KV caches (expertax.decoding) against decoding without one.

The oracle re-runs the whole model (`expertax.logits`) on the growing sequences at every step
and takes the argmax at each sequence's last position: no cache, no absorbed projections, no
per-sequence positions. Greedy decoding from the cache must give the same tokens, token for
token, for prompts of different lengths in one batch, and the same log-probabilities within
float32 tolerance; so must MLA's plain cache, the 8-device mesh (batch padded to its shards) and
MTP speculative decoding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import ConfigError, init_params, load_config, logits
from expertax.config.loader import config_rules
from expertax.decoding import (
    bytes_per_token,
    generate,
    joint,
    model,
    prepare,
    programs,
    sample,
    values_per_token,
    weights,
)
from expertax.decoding import cache as kv
from expertax.decoding.loop import check_request, decoding_config
from expertax.models import decoder
from expertax.sharding.mesh import make_mesh
from tests.tolerances import tol

PROMPTS = [[1, 5, 9, 3, 7], [2, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
NEW = 6


def _one():
    return jax.devices()[:1]


def _config(model_name: str, **over):
    keys = dict(model_name=model_name, dtype="float32", weight_dtype="float32", **over)
    return load_config(overrides=keys)


@pytest.fixture(scope="module")
def deepseek():
    c = _config("deepseek3-tiny", mtp_num_layers=1)
    return c, init_params(c)


@pytest.fixture(scope="module")
def mixtral():
    c = _config("mixtral-tiny")
    return c, init_params(c)


def oracle(c, params, prompts, n):
    """Greedy tokens and their log-probabilities by full forward passes, no cache."""
    width = max(len(p) for p in prompts) + n
    seqs = [list(p) for p in prompts]
    full = jax.jit(lambda p, t: logits(p, t, c))
    tokens = [[] for _ in prompts]
    lps = [[] for _ in prompts]
    for _ in range(n):
        batch = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            batch[i, : len(s)] = s
        out = np.asarray(full(params, jnp.asarray(batch)))
        for i, s in enumerate(seqs):
            row = out[i, len(s) - 1]
            t = int(np.argmax(row))
            lps[i].append(float(jax.nn.log_softmax(row)[t]))
            tokens[i].append(t)
            s.append(t)
    return tokens, lps


@pytest.fixture(scope="module")
def deepseek_oracle(deepseek):
    return oracle(*deepseek, PROMPTS, NEW)


@pytest.mark.parametrize("form", ["compressed", "plain"])
def test_mla_cache_greedy_equals_no_cache(deepseek, deepseek_oracle, form):
    c, params = deepseek
    g = generate(params, c, PROMPTS, max_new_tokens=NEW, mla_cache=form, devices=_one())
    want_tokens, want_lps = deepseek_oracle
    assert g.tokens == want_tokens
    np.testing.assert_allclose(np.array(g.logprobs), np.array(want_lps), **tol())
    assert g.finished == [False] * len(PROMPTS) and g.acceptance is None


def test_chunked_prefill(deepseek, deepseek_oracle, monkeypatch):
    """Prompts prefilled 4 positions at a time (the longest, 9, padded to 12), with the MTP
    module's prefill chunked alike (speculative decoding): the default chunk lowered, and the
    `prefill_chunk` setting."""
    c, params = deepseek
    g = generate(params, c, PROMPTS, max_new_tokens=NEW, devices=_one(), speculative=True,
                 prefill_chunk=4)  # fmt: skip
    assert g.tokens == deepseek_oracle[0]
    monkeypatch.setattr(programs, "PREFILL_CHUNK", 4)
    g = generate(params, c, PROMPTS, max_new_tokens=NEW, devices=_one(), speculative=True)
    assert g.tokens == deepseek_oracle[0]


@pytest.mark.parametrize("sparse", [True, False])
def test_gqa_cache_greedy_equals_no_cache(mixtral, sparse):
    """Mixtral's GQA cache; the MoE layer's sorted (dropless) path and its one-hot einsum path
    (sparse_matmul=false; decoding makes it dropless, capacity_factor=-1)."""
    c, params = mixtral
    if not sparse:
        c = _config("mixtral-tiny", sparse_matmul=False, capacity_factor=1.0)
    g = generate(params, c, PROMPTS, max_new_tokens=NEW, devices=_one())
    want_tokens, want_lps = oracle(decoding_config(c), params, PROMPTS, NEW)
    assert g.tokens == want_tokens
    np.testing.assert_allclose(np.array(g.logprobs), np.array(want_lps), **tol())
    prepared = prepare(params, c, devices=_one())  # the layers unstacked once, reused
    assert generate(prepared, c, PROMPTS, max_new_tokens=NEW, devices=_one()).tokens == g.tokens


def test_sharded_mesh_equals_one_device(mixtral):
    """The 8-device mesh (FSDP over the model's default mesh keys, the MoE layer's
    expert-parallel dispatch) with 3 prompts padded to 8 rows."""
    c, params = mixtral
    one = generate(params, c, PROMPTS, max_new_tokens=NEW, devices=_one())
    c8 = _config("mixtral-tiny", ici_fsdp_parallelism=2, ici_expert_parallelism=4)
    eight = generate(params, c8, PROMPTS, max_new_tokens=NEW)
    assert eight.tokens == one.tokens
    np.testing.assert_allclose(np.array(eight.logprobs), np.array(one.logprobs), **tol())


def test_one_device_joins_the_matrices_that_read_the_same_input(deepseek):
    """decoding/joint.py: on one device, float weights only; the joined matrix holds the parts
    side by side (the greedy tests above run this layout against the no-cache oracle)."""
    c, params = deepseek
    one = prepare(params, c, devices=_one())
    layer = one.moe_layers[0]
    assert joint.is_joint(layer.attn.wq_a) and layer.attn.wkv_a is None
    want = np.concatenate([params.moe_layers.attn.wq_a[0], params.moe_layers.attn.wkv_a[0]], -1)
    np.testing.assert_array_equal(np.asarray(layer.attn.wq_a.w), want)
    assert joint.is_joint(layer.moe.shared.wi_0) and layer.moe.shared.wi_1 is None
    assert all(map(joint.is_joint, layer.moe.wi_0)) and set(layer.moe.wi_1) == {None}
    assert joint.is_joint(one.dense_layers[0].mlp.wi_0)
    assert joint.is_joint(one.mtp.block.attn.wq_a)
    w0, w1 = params.moe_layers.moe.wi_0[0, 3], params.moe_layers.moe.wi_1[0, 3]
    np.testing.assert_array_equal(np.asarray(layer.moe.wi_0[3].w), np.concatenate([w0, w1], -1))
    sharded = prepare(params, c)  # 8 devices: the layouts the sharding rules name
    assert not joint.is_joint(sharded.moe_layers[0].attn.wq_a)
    assert not joint.is_joint(sharded.dense_layers[0].mlp.wi_0)
    quantized = prepare(params, c, devices=_one(), fp8_weights=True)
    assert not any(joint.is_joint(x) for x in jax.tree.leaves(quantized, is_leaf=joint.is_joint))


def test_sharded_output_head_is_held_over_the_vocabulary(mixtral):
    """decoding/model.py `head_spec`: under a mesh the head [D, V] is sharded along V, and the
    decode program multiplies by each device's slice instead of gathering the whole head (the
    sharded greedy run equals one device's: test_sharded_mesh_equals_one_device)."""
    c, params = mixtral
    c8 = decoding_config(_config("mixtral-tiny", ici_fsdp_parallelism=2, ici_expert_parallelism=4))
    head = prepare(params, c8).lm_head
    assert head.sharding.spec[0] is None and head.sharding.spec[1] is not None
    assert head.addressable_shards[0].data.shape == (c.base_emb_dim, c.vocab_size // 8)
    mesh = make_mesh(c8, jax.devices())
    text = programs.compile_for(c8, mesh, batch=8, prompt_len=4, budget=3).as_text()
    d, v = c.base_emb_dim, c.vocab_size
    gathers = [line for line in text.splitlines() if "all-gather(" in line]
    assert gathers and not [g for g in gathers if f"[{d},{v}]" in g.split("all-gather(")[0]]


def test_compressed_and_plain_mla_logits_agree(deepseek):
    """The absorbed (latent) and the plain (per-head) cache: prefill then one decode step."""
    c, params = deepseek
    dc = decoding_config(c)
    prompts = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)
    params = weights.layered(params, dc, make_mesh(dc, _one()), config_rules(dc))

    def run(form):
        cache = kv.allocate(dc, 1, 12, form, mtp=False)
        h, cache = model.main_step(params, prompts, jnp.zeros((1,), jnp.int32), cache, dc)
        nxt = jnp.argmax(model.logits(params, h[:, -1:], dc), -1).astype(jnp.int32)
        h2, _ = model.main_step(params, nxt, jnp.full((1,), 8, jnp.int32), cache, dc)
        return model.logits(params, jnp.concatenate([h, h2], 1), dc)

    compressed = jax.jit(lambda: run("compressed"))
    np.testing.assert_allclose(compressed(), jax.jit(lambda: run("plain"))(), **tol())


def test_cache_bytes_per_token():
    """MLA compressed: (kv_lora_rank + qk_rope_head_dim) values per token and layer (576 for
    DeepSeek-V3, about 71x fewer than the plain cache's H x (Qn+Qr+O)); GQA: 2 x G x head_dim.
    The allocated arrays hold exactly that."""
    v3 = load_config(overrides=dict(model_name="deepseek3-671b"))
    assert values_per_token(v3, "compressed") == 512 + 64
    assert values_per_token(v3, "plain") == 128 * (192 + 128)
    assert bytes_per_token(v3, "compressed") == 61 * 576 * 2
    assert bytes_per_token(v3, "plain") == 61 * 128 * 320 * 2
    assert bytes_per_token(v3, mtp=True) == 62 * 576 * 2
    for name, form in [("deepseek3-tiny", "compressed"), ("deepseek3-tiny", "plain"),
                       ("mixtral-tiny", "compressed")]:  # fmt: skip
        c = _config(name)
        cache = jax.eval_shape(lambda c=c, form=form: kv.allocate(c, 2, 10, form, mtp=False))
        held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
        assert held == bytes_per_token(c, form) * 2 * 10
    mixtral = _config("mixtral-tiny")
    assert values_per_token(mixtral) == 2 * 2 * 32


def test_speculative_equals_greedy_and_counts_acceptance(deepseek):
    """MTP drafts accepted at some steps and rejected at others: the output stays plain greedy
    decoding's. The MTP head is made to always draft token 0 (its head norm zeroed, so its
    logits are all zero) and the output head made to like token 0 at some positions."""
    c, params = deepseek
    head = params.embed if params.lm_head is None else params.lm_head.T  # [V, D]
    rows = head.at[0].set(head[1:9].sum(0))
    tuned = dataclasses.replace(
        params,
        embed=rows if params.lm_head is None else params.embed,
        lm_head=None if params.lm_head is None else rows.T,
        mtp=dataclasses.replace(params.mtp, head_norm=jnp.zeros_like(params.mtp.head_norm)),
    )
    n = 10
    plain = generate(tuned, c, PROMPTS, max_new_tokens=n, devices=_one())
    spec = generate(tuned, c, PROMPTS, max_new_tokens=n, devices=_one(), speculative=True)
    assert spec.tokens == plain.tokens
    np.testing.assert_allclose(np.array(spec.logprobs), np.array(plain.logprobs), **tol())
    assert spec.drafts_proposed > 0
    assert 0 < spec.drafts_accepted < spec.drafts_proposed, (spec, plain.tokens)
    # Every accepted draft saved one step: tokens = steps + accepted, per sequence.
    zeros = sum(row.count(0) for row in plain.tokens)
    assert spec.drafts_accepted <= zeros


def test_eos_stops_each_sequence(mixtral):
    c, params = mixtral
    full = generate(params, c, PROMPTS, max_new_tokens=NEW, devices=_one())
    eos = full.tokens[0][2]
    g = generate(params, c, PROMPTS, max_new_tokens=NEW, devices=_one(), eos_id=eos)
    for got, whole in zip(g.tokens, full.tokens, strict=True):
        cut = whole[: whole.index(eos) + 1] if eos in whole else whole
        assert got == cut
    assert g.finished[0] and g.tokens[0][-1] == eos


def test_sampling_is_reproducible_and_filtered(mixtral):
    c, params = mixtral
    kw = dict(max_new_tokens=NEW, temperature=0.8, top_k=5, devices=_one())
    a = generate(params, c, PROMPTS, seed=7, **kw)
    b = generate(params, c, PROMPTS, seed=7, **kw)
    other = generate(params, c, PROMPTS, seed=8, **kw)
    assert a.tokens == b.tokens and a.tokens != other.tokens
    # Each sampled token is among the 5 most likely under the model at its step.
    ref_lp = []
    for p, toks in zip(PROMPTS, a.tokens, strict=True):
        out = np.asarray(logits(params, jnp.asarray([p + toks]), c))[0]
        for i, t in enumerate(toks):
            row = out[len(p) - 1 + i]
            assert t in np.argsort(row)[-5:]
            ref_lp.append(float(jax.nn.log_softmax(row)[t]))
    np.testing.assert_allclose(sum(a.logprobs, []), ref_lp, **tol())


def test_top_k_and_top_p_masks():
    x = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]], jnp.float32))
    kept = lambda f: np.isfinite(np.asarray(f))[0].tolist()  # noqa: E731
    assert kept(sample.filtered(x, 1.0, 2, 1.0)) == [True, True, False, False, False]
    # top-p 0.6: 0.5 alone is short of it, 0.5 + 0.2 reaches it
    assert kept(sample.filtered(x, 1.0, 0, 0.6)) == [True, True, False, False, False]
    assert kept(sample.filtered(x, 1.0, 0, 0.7)) == [True, True, False, False, False]
    assert kept(sample.filtered(x, 1.0, 0, 0.71)) == [True, True, True, False, False]
    assert kept(sample.filtered(x, 1.0, 0, 0.1)) == [True, False, False, False, False]
    assert kept(sample.filtered(x, 1.0, 3, 0.99)) == [True, True, True, False, False]
    # temperature scales before filtering; greedy ignores filters
    np.testing.assert_allclose(sample.filtered(x, 2.0, 0, 1.0), x / 2)
    assert int(sample.choose(x, jax.random.key(0), 0.0, 0, 1.0)[0]) == 0
    draws = jax.vmap(lambda k: sample.choose(x, k, 1.0, 2, 1.0))(
        jax.random.split(jax.random.key(1), 400)
    )
    assert set(np.asarray(draws).ravel().tolist()) == {0, 1}


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(prompt_ids=[]), "prompts"),
        (dict(prompt_ids=[[]]), "prompt 0"),
        (dict(prompt_ids=[[1, 9999]]), "vocabulary"),
        (dict(prompt_ids=[[1] * 200]), "max_target_length=128"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(max_new_tokens=500), "max_new_tokens=500"),
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_k=-2), "top_k=-2"),
        (dict(mla_cache="latent"), "mla_cache='latent'"),
        (dict(speculative=True, temperature=0.5), "greedy"),
    ],
)
def test_bad_requests_are_refused_before_compiling(deepseek, kwargs, named):
    c, params = deepseek
    kw: dict = dict(prompt_ids=[[1, 2, 3]], max_new_tokens=4)
    kw.update(kwargs)
    prompts = kw.pop("prompt_ids")
    with pytest.raises((ConfigError, ValueError), match=named.replace("[", r"\[")):
        generate(params, c, prompts, **kw)


def test_recorded_routing_is_the_routers_choice_at_every_fed_position(mixtral):
    """`record_routing` returns, per sequence, the experts each MoE layer used for each prompt
    token (prefill) and each fed sampled token (decode steps), at its position: a forward pass
    without cache over the whole sequence (its routers' own choices) agrees, up to near-tie
    flips of another compute order (none at this seed in float32), and the same choices moved
    by one position do not. Recording changes neither the tokens nor their log-probabilities."""
    c, params = mixtral
    kw = dict(max_new_tokens=NEW, temperature=0.8, seed=5, devices=_one())
    plain = generate(params, c, PROMPTS, **kw)
    g = generate(params, c, PROMPTS, record_routing=True, **kw)
    assert g.tokens == plain.tokens and g.logprobs == plain.logprobs and g.routing is not None
    assert plain.routing is None
    k = c.num_experts_per_tok
    flips = moved = decisions = 0
    for p, toks, rec in zip(PROMPTS, g.tokens, g.routing, strict=True):
        seq = p + toks
        assert rec.shape == (c.num_moe_layers, len(seq), k) and (rec[:, -1] == -1).all()
        none = jnp.full((c.num_moe_layers, 1, len(seq), k), -1, jnp.int32)
        _, stats = decoder.forward(params, jnp.asarray([seq]), c, imposed_LBTK=none)
        own = np.asarray(stats.chosen_BTK)[:, 0, :-1]
        fed = rec[:, :-1]
        flips += int((~(fed[..., :, None] == own[..., None, :]).any(-1)).sum())
        shifted = np.roll(fed, 1, axis=1)
        moved += int((~(shifted[..., :, None] == own[..., None, :]).any(-1)).sum())
        decisions += fed.size
    assert flips <= decisions // 100, (flips, decisions)
    assert moved > decisions // 5, (moved, decisions)


@pytest.mark.parametrize(
    ("model_name", "kwargs", "named"),
    [
        ("deepseek3-tiny", dict(speculative=True), "recorded by the plain decode loop only"),
        ("llama-tiny", {}, "no MoE layers"),
    ],
)
def test_recording_the_routing_is_refused_where_there_is_none(model_name, kwargs, named):
    c = _config(model_name, mtp_num_layers=1 if kwargs else 0)
    kw: dict = dict(temperature=0.0, top_k=0, top_p=1.0, mla_cache="compressed")
    kw.update({"speculative": False, **kwargs})
    with pytest.raises(ConfigError, match=named):
        check_request(c, [[1, 2]], max_new_tokens=2, record_routing=True, **kw)


def test_speculative_needs_mtp(mixtral):
    c, params = mixtral
    with pytest.raises(ConfigError, match="mtp_num_layers"):
        generate(params, c, [[1, 2]], max_new_tokens=2, speculative=True)
