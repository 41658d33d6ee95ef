"""Splash attention (Pallas TPU kernel, run in Pallas' interpreter on the CPU) under context
parallelism against one-device attention on the same keys: MLA's layer path
(`mla.context_attend`: the gathered latent up-projected, the whole sequence's queries split over
`context`), outputs and the gradients of the queries, latent, RoPE key and `wkv_b`, packed
documents, with the load-balanced (permuted) rows and without; and that the block maps each
device takes skip the tiles its permuted rows never see."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from expertax import platform, targets
from expertax.config.loader import config_rules
from expertax.config.schema import MESH_AXES
from expertax.nn.attention import context, mla, splash
from expertax.nn.attention.kernel import attend_dot
from expertax.sharding import named_sharding, use_rules
from tests.tolerances import tol
from tests.unit.nn.attention.targets import needs_tpu
from tests.unit.nn.attention.test_context import _config as context_config
from tests.unit.nn.attention.test_context import _mesh, _under_cp

B, H, NOPE, QR, VD, R = 1, 2, 16, 8, 12, 24
SCALE = 0.3


def _inputs(t, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, t, H, NOPE + QR), jnp.float32)
    lat = jax.random.normal(ks[1], (B, t, R), jnp.float32)
    rope = jax.random.normal(ks[2], (B, t, QR), jnp.float32)
    wkv_b = jax.random.normal(ks[3], (R, H, NOPE + VD), jnp.float32) / np.sqrt(R)
    seg = jnp.cumsum(jax.random.bernoulli(ks[4], 0.01, (B, t)), axis=1).astype(jnp.int32)
    # `wkv_b`'s gradient sums over the whole sequence (1,024 rows): at unit output gradients
    # its entries reach 20 and float32 reorderings of that sum pass the table's atol on the
    # small ones; a tenth keeps every entry's reordering error under it
    d_out = 0.1 * jax.random.normal(ks[5], (B, t, H, VD), jnp.float32)
    return (q, lat, rope, wkv_b), seg, d_out


def _config(cp, balanced, tp, t, **more):
    return context_config(cp, "splash", balanced, tp=tp, max_target_length=t, **more)


def _reference(seg):
    def fn(q, lat, rope, wkv_b):
        kv = jnp.einsum("bsr,rhz->bshz", lat, wkv_b)
        k_rope = jnp.broadcast_to(rope[:, :, None], (*rope.shape[:2], H, QR))
        k = jnp.concatenate([kv[..., :NOPE], k_rope], -1)
        return attend_dot(q, k, kv[..., NOPE:], scale=SCALE, segment_ids_BT=seg)

    return fn


def _out_and_grads(fn, args, d_out):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(d_out))


# (cp, load balance, tensor): chunks of 128 rows (the kernel's smallest tile), so the permuted
# layout's rows change tiles within a device
# (the second on demand: CI's budget; the heads split over `tensor` is splash.py's own shard_map
# rule, and test_context.py splits them under the latent kernels)
CASES = [
    (4, True, 1),
    pytest.param(
        2,
        False,
        2,
        marks=[
            pytest.mark.full_grid,
            pytest.mark.covered_by(
                "tests/unit/nn/attention/test_context_splash.py::"
                "test_splash_under_context_parallelism_equals_one_device[4-True-1]",
                "tests/unit/nn/attention/test_splash.py::test_sharded_call_equals_one_device",
            ),
        ],
    ),
]


@pytest.mark.distributed
@pytest.mark.parametrize("cp, balanced, tp", CASES)
def test_splash_under_context_parallelism_equals_one_device(cp, balanced, tp):
    t = (2 * cp if balanced else cp) * splash.LANES
    args, seg, d_out = _inputs(t)
    want = jax.jit(lambda *a: _out_and_grads(_reference(seg), a, d_out))(*args)
    c = _config(cp, balanced, tp, t)
    fn = _under_cp(c, seg, True, t)
    with jax.set_mesh(_mesh(c)), use_rules(config_rules(c)), splash.interpret():
        assert "pallas_call" in str(jax.make_jaxpr(fn)(*args))
        got = jax.jit(lambda *a: _out_and_grads(fn, a, d_out))(*args)
    for name, w, x in zip(("out", "dq", "d latent", "d rope key", "d wkv_b"), want, got):
        np.testing.assert_allclose(x, w, **tol(jnp.float32), err_msg=name)
    other = jax.jit(_reference(jnp.roll(seg, 7, axis=1)))(*args)
    assert float(jnp.max(jnp.abs(other - got[0]))) > 1e-2


@pytest.mark.distributed
def test_gqa_splash_with_a_window_and_sinks_under_context_parallelism():
    """GQA's path (context.attend on gathered keys and values, 4 query heads on 2 kv heads) at
    cp=4, load balanced, a sliding window of 200 positions and attention sinks: the permuted
    rows' window and sinks against one-device attention, outputs and the three gradients."""
    from expertax.nn.attention.mask import MaskSpec  # noqa: PLC0415

    cp, t, h, g, d = 4, 1024, 4, 2, 32
    ks = jax.random.split(jax.random.key(3), 6)
    q = jax.random.normal(ks[0], (B, t, h, d), jnp.float32)
    k = jax.random.normal(ks[1], (B, t, g, d), jnp.float32)
    v = jax.random.normal(ks[2], (B, t, g, d), jnp.float32)
    sinks = jax.random.normal(ks[3], (h,), jnp.float32)
    seg = jnp.cumsum(jax.random.bernoulli(ks[4], 0.01, (B, t)), axis=1).astype(jnp.int32)
    d_out = 0.1 * jax.random.normal(ks[5], (B, t, h, d), jnp.float32)
    spec = MaskSpec(window=200)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))

    def reference(q, k, v, sinks):
        return attend_dot(q, k, v, scale=SCALE, segment_ids_BT=seg, mask_spec=spec,
                          q_positions_BT=pos, kv_positions_BS=pos, sink_logits_H=sinks)  # fmt: skip

    c = _config(cp, True, 1, t, model_name="llama-tiny", base_num_query_heads=h,
                base_num_kv_heads=g, head_dim=d)  # fmt: skip
    order = lambda a: context.reorder(a, cp)  # noqa: E731
    back = jnp.asarray(np.argsort(context.balanced_index(t, cp)))

    def under_cp(q, k, v, sinks):
        out = context.attend(order(q), (order(k), order(v)), lambda kv, _: kv, None, c,
                             positions_BT=order(pos), segment_ids_BT=order(seg), scale=SCALE,
                             sink_logits_H=sinks, mask_spec=spec)  # fmt: skip
        return jnp.take(out, back, axis=1)

    args = (q, k, v, sinks)
    want = jax.jit(lambda *a: _out_and_grads(reference, a, d_out))(*args)
    with jax.set_mesh(_mesh(c)), use_rules(config_rules(c)), splash.interpret():
        got = jax.jit(lambda *a: _out_and_grads(under_cp, a, d_out))(*args)
    for name, w, x in zip(("out", "dq", "dk", "dv", "d sinks"), want, got):
        np.testing.assert_allclose(x, w, **tol(jnp.float32), err_msg=name)


def test_permuted_block_maps_skip_what_each_device_never_sees():
    """cp = 2, load balanced, 4 chunks of 128 rows, tiles of 128: device 0 holds chunks 0 and 3,
    device 1 chunks 1 and 2. Each device's share of the forward block map is its rows' causal
    tiles: chunk k's row block sees key blocks 0..k (the last one partial)."""
    cp, t = 2, 4 * splash.LANES
    rows = context.balanced_index(t, cp)
    whole = splash._kernel(1, t, t, 0, splash.LANES, True, q_rows=rows, q_shards=cp)
    want = {0: [[1, 0, 0, 0], [2, 2, 2, 1]], 1: [[2, 1, 0, 0], [2, 2, 1, 0]]}
    for device, blocks in want.items():
        part = splash._shard_of(whole, jnp.int32(device), cp).fwd_mask_info
        np.testing.assert_array_equal(np.asarray(part.block_mask)[0], blocks)
        mine = rows[device * 256 : (device + 1) * 256]
        np.testing.assert_array_equal(np.asarray(part.q_sequence), mine)


@needs_tpu
@pytest.mark.extended  # ~10 s: Mosaic compiles the three kernels
def test_splash_under_context_parallelism_compiles_for_tpu():
    """mla.context_attend with splash at cp=4 on tpu:v5p-8, bfloat16, forward and backward:
    the forward, dq and dkv Mosaic kernels in the program, the latent (not per-head keys)
    all-gathered over `context`."""
    t, cp = 1024, 4
    spec = targets.parse_target("tpu:v5p-8")
    dims = {"qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "kv_lora_rank": 64}
    c = _config(cp, True, 1, t, dtype="bfloat16", ici_data_parallelism=1, **dims)
    shape = [cp if a == "context" else 1 for a in MESH_AXES]
    mesh = Mesh(np.array(spec.devices()[:cp]).reshape(shape), MESH_AXES)
    rules = config_rules(c)
    bf = jnp.bfloat16

    def arg(shape, axes, dtype=bf):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=named_sharding(mesh, axes, rules, shape))

    args = (
        arg((1, t, H, 96), ("batch", "length", "act_heads", None)),
        arg((1, t, 64), ("batch", "length", None)),
        arg((1, t, 32), ("batch", "length", None)),
        arg((64, H, 128), (None, "heads", None)),
        arg((1, t), ("batch", "length"), jnp.int32),
    )

    def loss(q, lat, rope, wkv_b, seg):
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (1, t))
        out = mla.context_attend(q, lat, rope, wkv_b, c, positions_BT=positions,
                                 segment_ids_BT=seg, scale=SCALE)  # fmt: skip
        return jnp.sum(out.astype(jnp.float32))

    with platform.use("tpu"), jax.set_mesh(mesh), use_rules(rules):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile().as_text()
    assert text.count('custom_call_target="tpu_custom_call"') >= 3
    # what is gathered: the latent [1, T, 64], RoPE key [1, T, 32], positions and segment ids;
    # the per-head keys would be [1, T, 2, 96]
    gathers = [
        line for line in text.splitlines() if " all-gather(" in line or "all-gather-start(" in line
    ]
    shape = re.compile(r"\b(?:bf16|f32|s32)\[([\d,]*)\]")
    sizes = [
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for line in gathers
        for dims in shape.findall(line.split("all-gather")[0])
    ]
    assert gathers and max(sizes) <= t * 64, gathers
