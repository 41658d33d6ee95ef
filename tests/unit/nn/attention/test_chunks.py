"""Token chunks for attention (`num_attention_token_chunks`): every kernel attends a chunk of
queries (against the keys up to its end, or from an offset known at run time) as the dot kernel
does on the whole sequence; an MLA and a GQA layer run in chunks (the scan and the Python loop)
equal the unchunked layer (outputs and gradients, with packed documents, under remat); the
config checks; and the chunked layer's compiled temporaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.config import ConfigError
from expertax.nn import param
from expertax.nn.attention import blockwise, chunks, cudnn, gqa, mla, splash
from expertax.nn.attention.kernel import attend, attend_dot
from expertax.preflight import load_config
from tests.tolerances import tol


def _seq(b=2, s=96, h=4, g=2, qd=16, od=24, seed=0):
    kq, kk, kv, ks, kc = jax.random.split(jax.random.key(seed), 5)
    seg = jnp.cumsum(jax.random.bernoulli(ks, 0.05, (b, s)), axis=1).astype(jnp.int32)
    return (
        jax.random.normal(kq, (b, s, h, qd), jnp.float32),
        jax.random.normal(kk, (b, s, g, qd), jnp.float32),
        jax.random.normal(kv, (b, s, g, od), jnp.float32),
        seg,
        jax.random.normal(kc, (b, s, h, od), jnp.float32),
    )


KERNELS = {
    "dot": attend_dot,
    "blockwise": lambda *a, **k: blockwise.attend_blockwise(*a, block_q=16, block_k=24, **k),
    "splash": lambda *a, **k: splash.attend_splash(*a, interpret=True, **k),
}


@pytest.mark.parametrize(
    "impl,keys",
    [
        ("dot", "up_to_the_end"),
        ("blockwise", "up_to_the_end"),
        pytest.param("splash", "up_to_the_end", marks=pytest.mark.extended),  # 8 s interpreted
        ("dot", "all_traced_offset"),
        ("blockwise", "all_traced_offset"),
    ],
)
def test_kernels_take_a_chunk_of_queries(impl, keys):
    """Queries 32..63 of 96 positions: against the keys up to their end (their causal mask
    aligned there), or against all 96 keys from an offset known only at run time (a scan's):
    the whole sequence's output rows and gradients (dq of those rows; dk, dv from those rows'
    cotangent only)."""
    q, k, v, seg, d_out = _seq(s=384 if impl == "splash" else 96)
    s = k.shape[1]
    lo, hi = s // 3, 2 * s // 3
    assert int(seg[:, lo:hi].max()) > int(seg[:, :lo].min())  # documents cross the cut
    d_rows = jnp.zeros_like(d_out).at[:, lo:hi].set(d_out[:, lo:hi])

    def whole(q, k, v):
        return attend_dot(q, k, v, scale=0.25, segment_ids_BT=seg)

    def rows(q_chunk, k, v, offset):
        if keys == "up_to_the_end":
            return KERNELS[impl](
                q_chunk, k[:, :hi], v[:, :hi], scale=0.25, segment_ids_BT=seg[:, :hi]
            )
        return attend(
            q_chunk,
            k,
            v,
            scale=0.25,
            segment_ids_BT=seg,
            impl=impl,
            q_offset=offset,
            mean_q_offset=lo,
        )

    out_w, vjp_w = jax.vjp(whole, q, k, v)
    dq_w, dk_w, dv_w = vjp_w(d_rows)
    fn = jax.jit(rows)
    out, vjp = jax.vjp(lambda a, b, c: fn(a, b, c, jnp.int32(lo)), q[:, lo:hi], k, v)
    dq, dk, dv = vjp(d_rows[:, lo:hi])
    for name, want, got in (
        ("out", out_w[:, lo:hi], out),
        ("dq", dq_w[:, lo:hi], dq),
        ("dk", dk_w, dk),
        ("dv", dv_w, dv),
    ):
        np.testing.assert_allclose(got, want, **tol(jnp.float32), err_msg=name)


def test_trace_time_masks_refuse_a_run_time_offset():
    q, k, v, seg, _ = _seq()
    with pytest.raises(ValueError, match="needs one of dot, blockwise"):
        attend(q[:, :32], k, v, scale=0.25, impl="splash", q_offset=jnp.int32(32))


def test_cudnn_refuses_a_chunk_and_auto_leaves_it(monkeypatch):
    q, k, v, seg, _ = _seq()
    with pytest.raises(ValueError, match="num_attention_token_chunks=1 or attention_impl"):
        cudnn.attend_cudnn(q[:, 64:], k, v, scale=0.25, flash=lambda *a: None)
    from expertax import platform
    from expertax.nn.attention import kernel

    monkeypatch.setattr(platform, "current", lambda: "gpu")
    monkeypatch.setattr(cudnn, "unusable_because", lambda *a, **k: None)
    args = dict(qk_dim=16, v_dim=16, dtype=jnp.bfloat16)
    assert kernel.resolve("auto", length=4096, **args) == "cudnn"
    assert kernel.resolve("auto", length=4096, chunked=True, **args) == "blockwise"


MODELS = {  # attention type: (model preset, overrides)
    "mla": ("deepseek3-tiny", {}),
    "gqa": ("mixtral-tiny", {}),
}


def _layer(kind, impl, chunks, remat_policy="full", t=64):
    preset, extra = MODELS[kind]
    c = load_config(
        overrides={
            "model_name": preset,
            "max_target_length": t,
            "attention_impl": impl,
            "num_attention_token_chunks": chunks,
            "remat_policy": remat_policy,
            **extra,
        }
    )
    module = mla if kind == "mla" else gqa
    p = param.initialize(module.spec(c), jax.random.key(1), jnp.float32)
    return c, module, p


@pytest.mark.parametrize(
    "kind,impl,remat_policy,loop",
    [
        ("mla", "dot", "full", "scan"),
        pytest.param("gqa", "blockwise", "minimal", "scan", marks=pytest.mark.extended),
        ("mla", "dot", "full", "python"),  # splash's loop, with the dot kernel on a CPU
        pytest.param("mla", "blockwise", "none", "scan", marks=pytest.mark.extended),
        pytest.param("gqa", "dot", "save_qkv_proj", "python", marks=pytest.mark.extended),
    ],
)
def test_layer_in_chunks_equals_the_whole_layer(kind, impl, remat_policy, loop, monkeypatch):
    if loop == "python":
        monkeypatch.setattr(chunks, "scanned", lambda *a: False)
    t = 64
    c1, module, p = _layer(kind, impl, 1, remat_policy, t)
    c4, _, _ = _layer(kind, impl, 4, remat_policy, t)
    kx, ks = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (2, t, c1.base_emb_dim), jnp.float32)
    seg = jnp.cumsum(jax.random.bernoulli(ks, 0.05, (2, t)), axis=1).astype(jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t), (2, t))

    def loss(c):
        def f(p, x):
            y, _ = module.apply(p, x, c, pos, seg, jnp.float32)
            return jnp.sum(jnp.sin(y)), y

        return jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True))

    (gp1, gx1), y1 = loss(c1)(p, x)
    (gp4, gx4), y4 = loss(c4)(p, x)
    np.testing.assert_allclose(y4, y1, **tol(jnp.float32), err_msg="out")
    np.testing.assert_allclose(gx4, gx1, **tol(jnp.float32), err_msg="dx")
    # weight gradients sum over every position; the chunks add the keys' and values' gradient
    # in another order, so the float32 tolerance applies relative to the gradient's scale
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(gp4), jax.tree.leaves(gp1)):
        scale = max(1.0, float(jnp.max(jnp.abs(b))))
        t32 = tol(jnp.float32)
        np.testing.assert_allclose(
            a, b, rtol=t32["rtol"], atol=t32["atol"] * scale, err_msg=f"{path} scale {scale}"
        )
    # negative control: the chunks' causal context cut at the chunk's start moves the output
    bad = attend(x[:, 16:32, None, :8], x[:, 16:32, None, :8], x[:, 16:32, None, :8], scale=1.0)
    good = attend(x[:, :32, None, :8], x[:, :32, None, :8], x[:, :32, None, :8], scale=1.0)
    assert float(jnp.max(jnp.abs(good[:, 16:] - bad))) > 10 * tol()["atol"]


def test_chunked_layer_holds_less_for_its_backward():
    """Compiled for the CPU at 1,024 positions with the dot kernel (whole score matrices): four
    query chunks hold under half the unchunked layer's temporaries in its forward+backward."""
    temps = {}
    for n in (1, 4):
        c, module, p = _layer("mla", "dot", n, "full", t=1024)
        x = jax.ShapeDtypeStruct((1, 1024, c.base_emb_dim), jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(1024), (1, 1024))

        def f(p, x, c=c, module=module, pos=pos):
            return jnp.sum(module.apply(p, x, c, pos, None, jnp.float32)[0])

        step = jax.jit(jax.grad(jax.checkpoint(f), argnums=(0, 1)))
        temps[n] = step.lower(p, x).compile().memory_analysis().temp_size_in_bytes
    assert temps[4] < 0.5 * temps[1], temps


@pytest.mark.parametrize(
    "overrides,words",
    [
        ({"num_attention_token_chunks": 3}, "does not divide max_target_length=64"),
        (
            {"num_attention_token_chunks": 2, "attention_impl": "cudnn", "dtype": "bfloat16"},
            "attention_impl=cudnn",
        ),
    ],
)
def test_config_refuses_what_chunks_cannot_do(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config(
            overrides={"model_name": "deepseek3-tiny", "max_target_length": 64, **overrides}
        )


# 25-47 s per kernel: on demand (CI's budget); chunks.py has no sharding code (GSPMD only), and
# the chunks' numerics on one device are default tests
_CHUNKS = "tests/unit/nn/attention/test_chunks.py::"


@pytest.mark.distributed
@pytest.mark.full_grid
@pytest.mark.parametrize(
    "impl",
    [
        pytest.param(
            impl,
            marks=pytest.mark.covered_by(
                f"{_CHUNKS}test_layer_in_chunks_equals_the_whole_layer[mla-dot-full-scan]",
                f"{_CHUNKS}test_layer_in_chunks_equals_the_whole_layer[mla-dot-full-python]",
                f"{_CHUNKS}test_kernels_take_a_chunk_of_queries[{impl}-up_to_the_end]",
                f"{_CHUNKS}test_kernels_take_a_chunk_of_queries[{impl}-all_traced_offset]",
                "tests/unit/nn/attention/test_splash.py::test_sharded_call_equals_one_device",
            ),
        )
        for impl in ("dot", "blockwise")
    ],
)
def test_chunks_under_a_mesh_match_one_device(impl):
    """Four query chunks (the scan) under a data x fsdp x tensor mesh (heads sharded), packed
    documents: loss and gradients equal the one-device unchunked model's."""
    from expertax import init_params
    from tests.sharded import assert_model_on_mesh_matches_one_device, two_document_batch

    small = {"max_target_length": 32, "per_device_batch_size": 1, "attention_impl": impl}
    mesh = {"ici_data_parallelism": 2, "ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 2}
    c = load_config(overrides={**small, **mesh, "num_attention_token_chunks": 4})
    one = load_config(overrides={**small, "ici_fsdp_parallelism": 1})
    p = init_params(one)
    batch = two_document_batch(c.vocab_size, 8, 32, 11)

    assert_model_on_mesh_matches_one_device(c, one, p, batch)
