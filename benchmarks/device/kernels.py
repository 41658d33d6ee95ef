"""The device check's kernel sections: the chip's dense bf16 matmul rate, the grouped-matmul
backends, and the attention kernels, each against a baseline timed in the same process.

Every record is a dict emitted through `ctx.emit` as soon as it is measured (check.py writes it
to the results file at once, so a section cut off by its time limit keeps what it measured).
Times are medians of `ctx.repeats` calls after one warm-up call (which compiles); FLOP rates
count the useful FLOPs (the routed rows, the causal half of attention), not what a kernel pads.
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from expertax import platform
from expertax.nn.attention import kernel as attention
from expertax.nn.moe import gmm as gmm_lib

# Expert shapes per device: DeepSeek-V3 (D 7168, F 2048, 256 experts: 8 per GPU at EP=32) and
# Qwen3-30B-A3B (D 2048, F 768, 128 experts: 16 per GPU at EP=8). Dry run: tiny.
GMM_SHAPES = {"deepseek-v3": (7168, 2048, 8), "qwen3-30b-a3b": (2048, 768, 16)}
GMM_ROWS = (128, 512, 2048)  # rows per expert
GMM_BACKENDS = ("tokamax_triton", "ragged_dot", "tokamax_mosaic_gpu", "tiled")
# Attention per device: Qwen3-30B-A3B's GQA (32 query heads, 4 kv heads, head dim 128) and
# DeepSeek-V3's MLA at tensor parallelism 8 (16 of its 128 heads; q/k 192, v 128).
ATTENTION_SHAPES = {"gqa-qwen3": (32, 4, 128, 128), "mla-deepseek-v3": (16, 16, 192, 128)}
ATTENTION_LENGTHS = (4096, 8192)
ATTENTION_IMPLS = ("dot", "cudnn", "blockwise")  # dot first: the baseline of the others

# The dry run (CPU, CI): every code path once, at sizes that compile in moments.
DRY = {
    "dense": 256,
    "gmm_shapes": {"deepseek-v3": (64, 32, 4)},
    "gmm_rows": (8,),
    "attention_shapes": {"gqa-qwen3": (4, 2, 16, 16), "mla-deepseek-v3": (2, 2, 24, 16)},
    "attention_lengths": (64,),
}


def median_seconds(fn, args, repeats: int) -> float:
    """Median wall seconds of `fn(*args)` over `repeats` calls, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _dtype(ctx):
    """bfloat16 on the GPU (what trains); float32 in the CPU dry run (XLA:CPU's bf16 dots are
    slow and the dry run only proves the code runs)."""
    return jnp.float32 if ctx.dry_run else jnp.bfloat16


def dense_peak(ctx) -> None:
    """The chip's dense matmul rate: [N, N] x [N, N] in the compute dtype, float32 accumulation;
    the denominator of the ratios below and of the train step's measured-peak MFU."""
    n = DRY["dense"] if ctx.dry_run else 8192
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), _dtype(ctx))
    b = jax.random.normal(k2, (n, n), _dtype(ctx))
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
    s = median_seconds(f, (a, b), ctx.repeats)
    ctx.dense_tflops = 2 * n**3 / s / 1e12
    ctx.emit(
        {
            "section": "dense",
            "shape": f"{n}x{n}x{n}",
            "dtype": jnp.dtype(_dtype(ctx)).name,
            "seconds": s,
            "tflops": ctx.dense_tflops,
            "spec_tflops": ctx.spec_tflops,
        }
    )


def _gmm_available(backend: str, on: str) -> str | None:
    """Why `backend` cannot run on platform `on` here, or None."""
    if backend.startswith("tokamax"):
        if on != "gpu":
            return "a GPU kernel"
        if importlib.util.find_spec("tokamax") is None:
            return "tokamax is not installed"
    return None


def _gmm_program(backend, mode, sizes, dtype):
    call = functools.partial(gmm_lib.gmm, backend=backend, preferred_element_type=dtype)
    if mode == "fwd":
        return jax.jit(lambda x, w: call(x, w, sizes))

    def loss(x, w, dy):
        return jnp.sum(call(x, w, sizes).astype(jnp.float32) * dy)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _dense_program(mode):
    def fwd(x, w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    if mode == "fwd":
        return jax.jit(fwd)
    return jax.jit(
        jax.grad(lambda x, w, dy: jnp.sum(fwd(x, w).astype(jnp.float32) * dy), argnums=(0, 1))
    )


def grouped_matmul(ctx) -> None:
    """Each backend's [E*r, D] x [E, D, F] grouped matmul (r rows per expert, balanced), forward
    and forward + backward, against the dense [E*r, D] x [D, F] matmul of the same FLOPs."""
    shapes = DRY["gmm_shapes"] if ctx.dry_run else GMM_SHAPES
    rows_list = DRY["gmm_rows"] if ctx.dry_run else GMM_ROWS
    dt, on = _dtype(ctx), platform.current()
    for name, (d, f, e) in shapes.items():
        for rows in rows_list:
            m = e * rows
            keys = jax.random.split(jax.random.key(1), 4)
            x = jax.random.normal(keys[0], (m, d), dt)
            w = (jax.random.normal(keys[1], (e, d, f), jnp.float32) / d**0.5).astype(dt)
            dy = jax.random.normal(keys[2], (m, f), jnp.float32)
            sizes = jnp.full((e,), rows, jnp.int32)
            for mode in ("fwd", "fwd_bwd"):
                if ctx.out_of_time():
                    return
                flops = 2 * m * d * f * (1 if mode == "fwd" else 3)
                args = (x, w[0]) if mode == "fwd" else (x, w[0], dy)
                dense_s = median_seconds(_dense_program(mode), args, ctx.repeats)
                base = dict(section="gmm", shape=name, d=d, f=f, experts=e, rows_per_expert=rows)
                ctx.emit(
                    {
                        **base,
                        "backend": "dense",
                        "mode": mode,
                        "seconds": dense_s,
                        "tflops": flops / dense_s / 1e12,
                    }
                )
                for backend in GMM_BACKENDS:
                    why = _gmm_available(backend, on)
                    rec = {**base, "backend": backend, "mode": mode}
                    if why:
                        ctx.emit({**rec, "skipped": why})
                        continue
                    if ctx.out_of_time():
                        return
                    prog = _gmm_program(backend, mode, sizes, dt)
                    args = (x, w) if mode == "fwd" else (x, w, dy)
                    try:
                        s = median_seconds(prog, args, ctx.repeats)
                    except Exception as err:  # noqa: BLE001 - recorded, the check goes on
                        ctx.emit({**rec, "error": f"{type(err).__name__}: {err}"[:300]})
                        continue
                    ctx.emit(
                        {**rec, "seconds": s, "tflops": flops / s / 1e12, "vs_dense": dense_s / s}
                    )


def _attention_flops(b, h, t, q, v, mode) -> float:
    """Useful FLOPs of causal attention: per (query, key) pair at or below the diagonal, forward
    2(Q + V) (scores, values), backward 2(3Q + 2V) (scores again, dO V^T, P^T dO, dS K, dS^T Q)."""
    pairs = b * h * t * (t + 1) / 2
    per_pair = 2 * (q + v) + (2 * (3 * q + 2 * v) if mode == "fwd_bwd" else 0)
    return pairs * per_pair


def _attention_program(impl, scale):
    def fwd(q, k, v):
        return attention.attend(q, k, v, scale=scale, impl=impl)

    def loss(q, k, v, do):
        return jnp.sum(fwd(q, k, v).astype(jnp.float32) * do)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def attention_kernels(ctx) -> None:
    """Forward + backward of causal attention, batch 1, by each implementation, against `dot`
    (whole score matrices) timed in the same run."""
    shapes = DRY["attention_shapes"] if ctx.dry_run else ATTENTION_SHAPES
    lengths = DRY["attention_lengths"] if ctx.dry_run else ATTENTION_LENGTHS
    dt, on = _dtype(ctx), platform.current()
    for name, (h, g, qd, vd) in shapes.items():
        for t in lengths:
            keys = jax.random.split(jax.random.key(2), 4)
            q = jax.random.normal(keys[0], (1, t, h, qd), dt)
            k = jax.random.normal(keys[1], (1, t, g, qd), dt)
            v = jax.random.normal(keys[2], (1, t, g, vd), dt)
            do = jax.random.normal(keys[3], (1, t, h, vd), jnp.float32)
            flops = _attention_flops(1, h, t, qd, vd, "fwd_bwd")
            dot_s = None
            for impl in ATTENTION_IMPLS:
                rec = dict(
                    section="attention",
                    shape=name,
                    heads=h,
                    kv_heads=g,
                    qk_dim=qd,
                    v_dim=vd,
                    length=t,
                    impl=impl,
                    mode="fwd_bwd",
                )
                if impl == "cudnn" and on != "gpu":
                    ctx.emit({**rec, "skipped": "a GPU kernel"})
                    continue
                if ctx.out_of_time():
                    return
                try:
                    s = median_seconds(
                        _attention_program(impl, qd**-0.5), (q, k, v, do), ctx.repeats
                    )
                except Exception as err:  # noqa: BLE001 - e.g. dot's scores over the HBM
                    ctx.emit({**rec, "error": f"{type(err).__name__}: {err}"[:300]})
                    continue
                dot_s = s if impl == "dot" else dot_s
                ctx.emit(
                    {
                        **rec,
                        "seconds": s,
                        "tflops": flops / s / 1e12,
                        "vs_dot": None if dot_s is None else dot_s / s,
                    }
                )


def gmm_reference_check(ctx) -> None:
    """Each runnable backend's forward against `tiled` on one small case: a backend that is fast
    because it is wrong must not win a table."""
    d, f, e, rows = 256, 128, 4, 64
    dt, on = _dtype(ctx), platform.current()
    keys = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(keys[0], (e * rows, d), dt)
    w = (jax.random.normal(keys[1], (e, d, f), jnp.float32) / d**0.5).astype(dt)
    sizes = jnp.asarray(np.array([rows // 2, rows, rows + rows // 2, rows]), jnp.int32)
    ref = np.asarray(gmm_lib.gmm(x, w, sizes, backend="tiled").astype(jnp.float32))
    for backend in GMM_BACKENDS:
        if backend == "tiled" or _gmm_available(backend, on):
            continue
        try:
            out = np.asarray(gmm_lib.gmm(x, w, sizes, backend=backend).astype(jnp.float32))
            err = float(np.max(np.abs(out - ref)) / (np.max(np.abs(ref)) + 1e-30))
            ctx.emit({"section": "gmm_check", "backend": backend, "max_rel_err_vs_tiled": err})
        except Exception as e:  # noqa: BLE001
            ctx.emit({"section": "gmm_check", "backend": backend, "error": str(e)[:300]})
