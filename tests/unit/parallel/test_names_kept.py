"""Every checkpoint name keeps its contract on every path: placed alone on `device` (or
`offload`), it is among the residuals a layer saves, or the config is refused before compiling
with the reason (parallel/remat.py `unkept`, parallel/checks.py `check_placements`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.tolerances import tol
from tests.unit.models.test_decoder import lm_batch
from tests.unit.nn.moe.test_moe import case as moe_case

from expertax import init_params
from expertax.config import ConfigError
from expertax.nn.moe import layer
from expertax.nn.moe import stash as stash_mod
from expertax.parallel import remat
from expertax.planner.residuals import layer_residuals, names_not_saved, residual_sources
from expertax.preflight import load_config
from expertax.train import step as step_lib
from expertax.train.trainer import build_trainer

SHORT = {"max_target_length": 16, "per_device_batch_size": 1}
EP = {"ici_expert_parallelism": 4, "ici_fsdp_parallelism": 2, "a2a_impl": "padded"}
# path -> (overrides, stack): every dispatch path of the MoE layer and the dense MLP layer
PATHS = {
    "dense-mlp": ({"model_name": "deepseek3-tiny"}, "dense"),
    "dense-gqa": ({"model_name": "llama-tiny"}, "dense"),
    "moe-einsum": ({"model_name": "deepseek3-tiny", "sparse_matmul": False}, "moe"),
    "moe-fused": ({"model_name": "deepseek3-tiny"}, "moe"),
    "moe-separate": ({"model_name": "deepseek3-tiny", "moe_fused_routed_ffn": False}, "moe"),
    "moe-fused-a2a": ({"model_name": "mixtral-tiny", **EP}, "moe"),
    "moe-fused-ring": ({"model_name": "mixtral-tiny", **EP, "use_ring_of_experts": True}, "moe"),
    "moe-stash": ({"model_name": "mixtral-tiny", "moe_paged_stash": True}, "moe"),
    "moe-stash-separate": (
        {"model_name": "mixtral-tiny", "moe_paged_stash": True, "moe_fused_routed_ffn": False},
        "moe",
    ),
}
PLAIN = [p for p in PATHS if "stash" not in p]


def _config(path: str, name: str, place: str):
    over, _ = PATHS[path]
    keep = {"remat_policy": "custom", name: place}
    if "stash" in path and name not in remat.STASHABLE:
        keep["moe_mlpwo"] = remat.DEVICE  # the stash needs one stashed name
    return load_config(overrides={**SHORT, **over, **keep})


def _saved_names(c, stack: str) -> set[str]:
    """The names of the residuals one layer of `stack` saves, traced on the config's mesh (the
    MoE `shard_map` under expert parallelism) with the per-device batch."""
    if c.ici_expert_parallelism == 1:
        return {r.name for r in layer_residuals(c, moe=stack == "moe", batch_local=1)}
    trainer = build_trainer(c)
    with trainer.context():  # the global batch: the shard_map gives each shard its part
        res = layer_residuals(c, moe=stack == "moe", batch_local=trainer.global_batch)
    return {r.name for r in res}


def _stash_residual_shapes(c) -> list[tuple[int, ...]]:
    """Shapes of the residuals the train step's loss saves (the stashed stack's own VJP)."""
    p = init_params(c)
    batch = lm_batch(c, 2)
    loss = lambda p: step_lib.loss_fn(p, batch, c)[0]
    return [tuple(s.aval.shape) for s in residual_sources(loss, p)]


def _assert_stashed(c, name: str) -> None:
    """The stashed stack saves the stacked layer inputs and one shared buffer per stashed name."""
    shapes = _stash_residual_shapes(c)
    if name == remat.DECODER_LAYER_INPUT:
        assert (c.num_moe_layers, 2, c.max_target_length, c.base_emb_dim) in shapes
        return
    widths = stash_mod.widths(c, {})
    assert name in widths
    cap = stash_mod.capacity_rows(c, c.num_moe_layers, 2 * c.max_target_length, {})
    rows = cap + c.moe_paged_stash_page_rows
    assert sorted(s[1] for s in shapes if len(s) == 2 and s[0] == rows) == sorted(widths.values())


# What covers an on-demand cell (covered_by): the same name by default on the most alike path
# (names are placed at shared sites: attention by type, MLA on deepseek's paths and GQA on
# llama's and mixtral's; the MoE names by dispatch family; a stash path's by the other stash
# path), and the same path by default with the neighbouring name.
_LIKE_ATTENTION = {
    "dense-mlp": ("moe-einsum", "moe-fused", "moe-separate"),
    "dense-gqa": ("moe-fused-a2a", "moe-fused-ring", "moe-stash", "moe-stash-separate"),
    "moe-einsum": ("moe-fused", "moe-separate", "dense-mlp"),
    "moe-fused": ("moe-separate", "moe-einsum", "dense-mlp"),
    "moe-separate": ("moe-fused", "moe-einsum", "dense-mlp"),
    "moe-fused-a2a": ("moe-fused-ring", "dense-gqa", "moe-stash", "moe-stash-separate"),
    "moe-fused-ring": ("moe-fused-a2a", "dense-gqa", "moe-stash", "moe-stash-separate"),
    "moe-stash": ("moe-stash-separate", "moe-fused-a2a", "moe-fused-ring", "dense-gqa"),
    "moe-stash-separate": ("moe-stash", "moe-fused-a2a", "moe-fused-ring", "dense-gqa"),
}
_LIKE_DISPATCH = {
    "dense-mlp": ("moe-fused", "moe-einsum", "moe-separate"),
    "dense-gqa": (),
    "moe-einsum": ("moe-separate", "moe-fused"),
    "moe-fused": ("moe-fused-ring", "moe-fused-a2a", "moe-stash"),
    "moe-separate": ("moe-stash-separate", "moe-einsum"),
    "moe-fused-a2a": ("moe-fused-ring", "moe-fused"),
    "moe-fused-ring": ("moe-fused-a2a", "moe-fused"),
    "moe-stash": ("moe-stash-separate", "moe-fused"),
    "moe-stash-separate": ("moe-stash", "moe-separate"),
}
_HERE = "tests/unit/parallel/test_names_kept.py::"
_CELL = _HERE + "test_a_name_placed_on_device_is_saved_or_refused"
_EXTRA = {  # the fused path's kept names, by default elsewhere too
    ("moe-fused", "moe_mlpwo"): (f"{_HERE}test_offloaded_names_are_saved_on_the_host[device]",),
    ("moe-fused", "moe_mlpwi_0"): (
        "tests/unit/nn/moe/test_chunks.py::test_checkpoint_names_work_inside_the_chunk_loop[fused]",
    ),
}


def _covered_by(i, path, j, name):
    paths, names = list(PATHS), remat.ALL_NAMES
    like = _LIKE_DISPATCH if name in remat.STASHABLE else _LIKE_ATTENTION
    same_name = [p for p in like[path] if (paths.index(p) + j) % 2 == 0][:1]
    ids = [f"{_CELL}[{p}-{name}]" for p in same_name]
    neighbours = [k for k in (j - 1, j + 1) if 0 <= k < len(names)]
    ids += [f"{_CELL}[{path}-{names[k]}]" for k in neighbours[: 1 if same_name else 2]]
    return pytest.mark.covered_by(*ids, *_EXTRA.get((path, name), ()))


def _case(i, path, j, name):
    """Each path with every other name by default (each name on every other path), the other
    half on demand (-m full_grid): CI's budget."""
    marks = [pytest.mark.distributed] if "a2a" in path or "ring" in path else []
    if (i + j) % 2:
        marks += [pytest.mark.full_grid, _covered_by(i, path, j, name)]
    return pytest.param(path, name, marks=marks, id=f"{path}-{name}")


@pytest.mark.parametrize(
    "path, name",
    [_case(i, p, j, n) for i, p in enumerate(PATHS) for j, n in enumerate(remat.ALL_NAMES)],
)
def test_a_name_placed_on_device_is_saved_or_refused(path, name):
    over, stack = PATHS[path]
    plain = load_config(overrides={**SHORT, **over, **_stash_keys(path)})
    try:
        c = _config(path, name, remat.DEVICE)
    except ConfigError as e:
        assert name in remat.unkept(plain), f"{name} refused on {path}: {e}"
        assert str(e).startswith(f"{name}=device: ") and len(str(e)) > 60
        return
    assert name not in remat.unkept(c)
    kept = remat.names_kept(c).get(stack, [])
    if name not in kept:  # kept by the other stack (a dense layer), not this one
        assert any(name in v for v in remat.names_kept(c).values()), name
        assert name in remat.unkept_in_stack(c, stack)
        return
    if "stash" in path:
        _assert_stashed(c, name)
        return
    assert name in _saved_names(c, stack), (path, name)


def _stash_keys(path: str) -> dict:
    return {"remat_policy": "custom", "moe_mlpwo": "device"} if "stash" in path else {}


@pytest.mark.parametrize("place", [remat.DEVICE, remat.OFFLOAD])
def test_offloaded_names_are_saved_on_the_host(place):
    """The report's placement follows the config: the fused path's kept expert outputs on host
    when offloaded (the real policy's host placement: tests/unit/parallel/test_remat.py)."""
    c = load_config(
        overrides={
            **SHORT,
            "model_name": "deepseek3-tiny",
            "remat_policy": "custom",
            "moe_mlpwo": place,
        }
    )
    got = {r.name: r.placement for r in layer_residuals(c, moe=True, batch_local=1)}
    assert got[remat.MOE_MLPWO] == ("host" if place == remat.OFFLOAD else "device")


def test_fused_gradients_with_the_expert_outputs_kept_equal_recomputed():
    """The fused routed FFN with moe_mlpwo kept (the backward reads the routing weights'
    gradient from the stored outputs) gives the gradients of moe_mlpwo on remat (from the
    hidden), to float32 rounding, for the MoE layer under its remat policy; a perturbed
    router weight is seen (negative control)."""
    base = {"model_name": "deepseek3-tiny", "max_target_length": 16}
    c_remat, p, x = moe_case({**base, "remat_policy": "full"})
    c_kept = load_config(overrides={**base, "remat_policy": "custom", "moe_mlpwo": "offload"})
    ct = jax.random.normal(jax.random.key(4), x.shape)

    def grads(c, p):
        def loss(p, x):
            body = lambda x, p: layer.apply(p, x, c, jnp.float32)[:2]
            y, st = remat.wrap_layer(body, c, prevent_cse=False)(x, p)
            return jnp.sum(y * ct) + st.lb_loss

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x)

    want, got = grads(c_remat, p), grads(c_kept, p)
    router_w = want[0].router.w
    assert float(jnp.abs(router_w).max()) > 0
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol(jnp.float32))
    other = dataclasses.replace(p, router=dataclasses.replace(p.router, w=p.router.w * 1.01))
    moved = grads(c_kept, other)[0].router.w
    assert not np.allclose(np.asarray(moved), np.asarray(router_w), **tol(jnp.float32))


def test_the_report_names_each_placed_name_no_residual_carries():
    """`minimal` places mlpwo, qkv_proj, the MoE output and MLA's names on device; a dense GQA
    model saves none of them, and the report says why for each (names_not_saved)."""
    c = load_config(overrides={**SHORT, "model_name": "llama-tiny", "remat_policy": "minimal"})
    res = layer_residuals(c, moe=False, batch_local=1)
    missing = names_not_saved(c, res)
    mla = {remat.QUERY_WA_PROJ, remat.KV_WA_PROJ, remat.MLA_Q, remat.MLA_KV}
    assert set(missing) == {remat.QKV_PROJ, remat.MLPWO, remat.MOE_MLPWO, *mla}
    assert "residual add" in missing[remat.MLPWO]
    assert "no routed experts" in missing[remat.MOE_MLPWO]
    assert "attention_type=gqa" in missing[remat.MLA_Q]
    assert set(remat.names_kept(c)["dense"]).isdisjoint(missing)
    # negative control: a report whose residuals lack a saved name lists it too
    assert remat.OUT_PROJ in names_not_saved(c, [r for r in res if r.name != remat.OUT_PROJ])
