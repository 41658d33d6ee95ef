"""MLA attention under context parallelism (context.py, mla.context_attend) against one-device
attention on the up-projected keys: outputs and gradients of the queries, latent, RoPE key and
`wkv_b`, at cp = 4 (beside data = 2) and cp = 8, packed documents, load balance on and off, the
`dot` kernel and the `blockwise` one (latent_blockwise.py, blocks of 8 rows: several per chunk);
the latent kernel alone against the blockwise kernel on expanded keys; and that the fused path
never materializes the whole sequence's per-head keys."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from expertax.config.loader import config_rules
from expertax.config.schema import MESH_AXES
from expertax.nn.attention import context, latent_blockwise, latent_ring, mla
from expertax.nn.attention.blockwise import attend_blockwise
from expertax.nn.attention.kernel import attend_dot
from expertax.preflight import load_config
from expertax.sharding import use_rules
from tests.tolerances import tol

# DeepSeek-V3's MLA dims shrunk: Qn 128 -> 16, Qr 64 -> 8, O 128 -> 12 (Qn != O), Rkv 512 -> 24
B, T, H, NOPE, QR, VD, R = 2, 64, 2, 16, 8, 12, 24
SCALE = 0.3


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, T, H, NOPE + QR), jnp.float32)
    lat = jax.random.normal(ks[1], (B, T, R), jnp.float32)
    rope = jax.random.normal(ks[2], (B, T, QR), jnp.float32)
    wkv_b = jax.random.normal(ks[3], (R, H, NOPE + VD), jnp.float32) / np.sqrt(R)
    # packed documents: boundaries where a coin says so, so some fall inside a device's chunk
    seg = jnp.cumsum(jax.random.bernoulli(ks[4], 0.1, (B, T)), axis=1).astype(jnp.int32)
    d_out = jax.random.normal(ks[5], (B, T, H, VD), jnp.float32)
    return q, lat, rope, wkv_b, seg, d_out


def _expanded(lat, rope, wkv_b):
    kv = jnp.einsum("bsr,rhz->bshz", lat, wkv_b)
    k_rope = jnp.broadcast_to(rope[:, :, None], (*rope.shape[:2], H, QR))
    return jnp.concatenate([kv[..., :NOPE], k_rope], -1), kv[..., NOPE:]


def _reference(seg):
    def fn(q, lat, rope, wkv_b):
        return attend_dot(q, *_expanded(lat, rope, wkv_b), scale=SCALE, segment_ids_BT=seg)

    return fn


def _out_and_grads(fn, args, d_out):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(d_out))


def _jitted(fn, d_out):
    """One compiled program for the output and the four gradients."""
    return jax.jit(lambda *args: _out_and_grads(fn, args, d_out))


def _config(cp, impl, balanced, strategy="all_gather", tp=1, **more):
    over = {
        "context_parallel_strategy": strategy,
        "model_name": "deepseek3-tiny",
        "ici_context_parallelism": cp,
        "ici_tensor_parallelism": tp,
        "ici_data_parallelism": 8 // (cp * tp),
        "ici_fsdp_parallelism": 1,
        "attention_impl": impl,
        "context_parallel_load_balance": balanced,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": QR,
        "v_head_dim": VD,
        "kv_lora_rank": R,
        **more,
    }
    return load_config(overrides=over)


def _mesh(c):
    sizes = {a: getattr(c, f"ici_{a}_parallelism") for a in MESH_AXES}
    devices = np.array(jax.devices()[:8]).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(devices, MESH_AXES)


def _under_cp(c, seg, fused, t=T):
    """mla.context_attend under the mesh, its inputs and outputs in sequence order."""
    cp, balanced = c.ici_context_parallelism, c.context_parallel_load_balance
    order = (lambda a: context.reorder(a, cp)) if balanced else (lambda a: a)
    back = np.argsort(context.balanced_index(t, cp)) if balanced else np.arange(t)
    positions = order(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (seg.shape[0], t)))

    def fn(q, lat, rope, wkv_b):
        out = mla.context_attend(
            order(q), order(lat), order(rope), wkv_b, c, positions_BT=positions,
            segment_ids_BT=order(seg), scale=SCALE, fused=fused,
        )  # fmt: skip
        return jnp.take(out, jnp.asarray(back), axis=1)

    return fn


@pytest.fixture
def small_blocks(monkeypatch):
    for module, name in ((latent_blockwise, "attend_latent_blockwise"),
                         (latent_ring, "attend_latent_ring")):  # fmt: skip
        fn = functools.partial(getattr(module, name), block_q=4, block_k=8)
        monkeypatch.setattr(module, name, fn)


# (cp, impl, load balance, fused, strategy, tensor): each kernel at both cp and with and
# without load balance; query chunks of 16 rows (cp 4), 4 rows (cp 8, balanced: blocks of 4 x 8,
# eight key blocks), 8 rows; blockwise on the expanded keys (`fused` off: GQA's path, blocks of
# 512); the ring (latent_ring.py) at cp 8 balanced (chunks of 4 rows) and cp 4 not (16 rows,
# 2 x 4 blocks per chunk pair: the causal skip inside the diagonal pair); the heads split over
# `tensor` (the latent's gradient summed over the head shards) for both latent kernels. The
# unbalanced all_gather at cp 4 on demand (cp 2's covers it); the unbalanced ring at cp 4 in the
# extended run (every default ring case is balanced)
CASES = [
    pytest.param(
        4,
        "blockwise",
        False,
        True,
        "all_gather",
        1,
        marks=[
            pytest.mark.full_grid,
            pytest.mark.covered_by(
                "tests/unit/nn/attention/test_context.py::"
                "test_context_parallel_mla_equals_one_device[2-blockwise-False-True-all_gather-2]"
            ),
        ],
    ),
    (8, "blockwise", True, True, "all_gather", 1),
    (4, "blockwise", True, False, "all_gather", 1),
    (4, "dot", True, True, "all_gather", 1),
    (8, "dot", False, True, "all_gather", 1),
    (8, "blockwise", True, True, "ring", 1),
    pytest.param(4, "blockwise", False, True, "ring", 1, marks=pytest.mark.extended),
    (2, "blockwise", True, True, "ring", 2),
    (2, "blockwise", False, True, "all_gather", 2),
]


@pytest.mark.distributed
@pytest.mark.parametrize("cp, impl, balanced, fused, strategy, tp", CASES)
def test_context_parallel_mla_equals_one_device(cp, impl, balanced, fused, strategy, tp,
                                                small_blocks):  # fmt: skip
    q, lat, rope, wkv_b, seg, d_out = _inputs()
    args = (q, lat, rope, wkv_b)
    want = _jitted(_reference(seg), d_out)(*args)
    c = _config(cp, impl, balanced, strategy, tp)
    fn = _under_cp(c, seg, fused)
    with jax.set_mesh(_mesh(c)), use_rules(config_rules(c)):
        assert context.size() == cp
        jaxpr = str(jax.make_jaxpr(fn)(*args))
        got = _jitted(fn, d_out)(*args)
    # blockwise: the latent kernel or, not fused, the expanded keys' kernel; dot: neither
    ring = strategy == "ring"
    assert ("name=_ring" in jaxpr) == ring
    assert ("all_gather" in jaxpr) == (not ring)
    assert ("name=_latent_attention" in jaxpr) == (impl == "blockwise" and fused and not ring)
    assert ("name=_blocked_attention" in jaxpr) == (impl == "blockwise" and not fused)
    for name, w, x in zip(("out", "dq", "d latent", "d rope key", "d wkv_b"), want, got):
        np.testing.assert_allclose(x, w, **tol(jnp.float32), err_msg=name)
    # negative control: other documents (segments shifted at one boundary) change the output
    other = jax.jit(_reference(jnp.roll(seg, 5, axis=1)))(*args)
    assert float(jnp.max(jnp.abs(other - got[0]))) > 1e-2


def test_latent_kernel_equals_blockwise_on_expanded_keys_and_holds_none():
    """attend_latent_blockwise with a query offset (the last 20 queries), uneven blocks and a
    length not a multiple of the block: values and all four gradients equal the blockwise
    kernel's on the expanded keys; and its compiled forward+backward has no buffer of the whole
    sequence's up-projection ([B, S, H, Qn+O] or its key or value part, either layout), which the
    expand-then-attend program has (negative control)."""
    q, lat, rope, wkv_b, seg, d_out = _inputs(seed=1)
    t = 20
    q, d_out = q[:, -t:], d_out[:, -t:]
    kw = dict(scale=SCALE, segment_ids_BT=seg, q_offset=jnp.int32(T - t), block_q=8, block_k=12)

    def expanded(q, lat, rope, wkv_b):
        return attend_blockwise(q, *_expanded(lat, rope, wkv_b), **kw)

    def fused(q, lat, rope, wkv_b):
        return latent_blockwise.attend_latent_blockwise(q, lat, rope, wkv_b, **kw)

    # the keys' full width Qn+Qr is the queries' too, so it is no sign
    shapes = {f"[{B},{T},{H},{d}]" for d in (NOPE + VD, NOPE, VD)}
    shapes |= {f"[{B},{H},{T},{d}]" for d in (NOPE + VD, NOPE, VD)}
    args = (q, lat, rope, wkv_b)
    results, held = {}, {}
    for name, fn in (("expanded", expanded), ("fused", fused)):
        compiled = _jitted(fn, d_out).lower(*args).compile()
        held[name] = {s for s in shapes if s in compiled.as_text()}
        results[name] = compiled(*args)
    for name, w, x in zip(("out", "dq", "d latent", "d rope key", "d wkv_b"), *results.values()):
        np.testing.assert_allclose(x, w, **tol(jnp.float32), err_msg=name)
    assert not held["fused"]
    assert held["expanded"]
