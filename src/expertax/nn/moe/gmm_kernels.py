"""Grouped-matmul backends that call maintained accelerator kernels (`gmm.gmm` dispatches here).

| backend | runs on | kernels (forward, input gradient; weight gradient) |
|---|---|---|
| `tokamax_triton` | GPU (sm80+) | `tokamax.ragged_dot_general`, Pallas Triton |
| `tokamax_mosaic_gpu` | GPU (Hopper) | `tokamax.ragged_dot_general`, Pallas Mosaic GPU |
| `megablox` | TPU | megablox `gmm`; `tgmm` (Pallas Mosaic TPU) |

Why libraries and not our own kernels: tokamax (Google DeepMind's kernel library) and megablox
(JAX's Pallas TPU ops, MaxText's grouped matmul) are maintained against the compilers they
target; what expertax adds is the contract of `gmm.gmm` around them.

One custom VJP serves the three (`_kernel_gmm`): the forward pass is one grouped-matmul kernel,
the input gradient the same kernel with the weights contracted on their output dim, the weight
gradient one transposed grouped-matmul kernel (tgmm: rows contracted per group, an `[E, D, F]`
result). Each kernel's grid covers the rows in row blocks, and only blocks that hold rows of a
group do work: the cost follows the routed rows plus at most one partial block per group
(planner/kernels.py counts it), never a product over all experts.

What the wrapper adds to the kernels:
- rows outside the local groups (past `sum(group_sizes)`, or of other shards' experts under
  `group_offset`) are zero in the output and in the input gradient: the kernels never write
  them (uninitialised device memory; Pallas's interpreter fills them with NaN), so both are
  masked, one elementwise pass each;
- `group_offset`: megablox takes it; tokamax refuses it, so the rows are rolled to put the local
  groups first, and rolled back (two copies of the rows);
- bfloat16 operands accumulate in float32 inside every kernel; the result is `out_dtype`;
- inside expertax's `shard_map` with vma checking, a Pallas call's output carries no varying
  axes and the checker refuses it: the kernels run in a nested `shard_map` over no axes with the
  check off, and their results are typed as varying over the operands' axes (the pipeline's
  MoE `shard_map` runs unchecked: there they are called directly);
- tokamax reads the GPU generation from JAX's default device: while tracing for a GPU target on
  a CPU machine, the target's device (`platform.device()`) is the default for the call;
- megablox needs the rows to be a multiple of its row tile; other row counts are zero-padded.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import importlib.util
import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from expertax import platform, scopes
from expertax.errors import ConfigError
from expertax.nn.moe.vma import varying_axes, varying_like, varying_over

# backend: (platforms it runs on, the Python package it needs, how to install it)
KERNELS = {
    "tokamax_triton": (("gpu",), "tokamax", "pip install 'expertax[gpu]' (tokamax)"),
    "tokamax_mosaic_gpu": (("gpu",), "tokamax", "pip install 'expertax[gpu]' (tokamax)"),
    "megablox": (("tpu",), "jax", "pip install 'expertax[tpu]'"),
}
TOKAMAX_IMPLEMENTATION = {"tokamax_triton": "triton", "tokamax_mosaic_gpu": "mosaic_gpu"}

# megablox's row tile: the rows per group under balanced routing, as a power of two in
# [MEGABLOX_MIN_ROWS, MEGABLOX_MAX_ROWS] (a group of 16 rows is then one 16-row block, not a
# 512-row one); K and N tiles as MaxText's defaults (1024), or the whole dim when smaller.
MEGABLOX_MIN_ROWS = 16
MEGABLOX_MAX_ROWS = 512
MEGABLOX_MAX_KN = 1024
# tokamax's row block (Triton's block_m for gmm, block_k for tgmm; Mosaic GPU's block_m) is
# capped at the rows per group under balanced routing, down to 16 rows (Triton's smallest dot).
TOKAMAX_MIN_ROWS = 16

_RAGGED = jax.lax.RaggedDotDimensionNumbers
_GMM_DIMS = _RAGGED((([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_GMM_T_DIMS = _RAGGED((([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_TGMM_DIMS = _RAGGED((([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])

_INTERPRET: contextvars.ContextVar[bool] = contextvars.ContextVar("gmm_interpret", default=False)


@contextlib.contextmanager
def interpret():
    """Run the Pallas TPU kernels (megablox) in Pallas's interpreter, also on the CPU platform:
    for tests of their numerics (slow: seconds per call at test sizes)."""
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def _interpret_mode():
    """megablox's `interpret` argument: Pallas's generic interpreter (the faster one at test
    sizes), or inside a vma-checked shard_map its TPU interpreter (the generic one retraces the
    kernel at lowering with the operands' varying-axes types and fails on its own carries)."""
    if not _INTERPRET.get():
        return False
    if not _checks_vma():
        return True
    return importlib.import_module("jax.experimental.pallas.tpu").InterpretParams()


def kernels_on(on: str) -> list[str]:
    """The kernel backends whose kernels run on platform `on`."""
    return [k for k, (platforms, _, _) in KERNELS.items() if on in platforms]


def missing_package(backend: str) -> str | None:
    """What installs the package kernel backend `backend` needs, when it is not installed."""
    if backend not in KERNELS:
        return None
    _, package, install = KERNELS[backend]
    if importlib.util.find_spec(package) is None:
        return f"needs the {package} package: {install}"
    return None


def check(backend: str, on: str) -> None:
    """ConfigError (before any compilation) when `backend` cannot run on platform `on` or its
    library is missing; names the key, the value and what is valid there."""
    if backend not in KERNELS:
        return
    platforms = KERNELS[backend][0]
    if on not in platforms and not (on == "cpu" and _INTERPRET.get() and backend == "megablox"):
        valid = ["auto", "tiled", "ragged_dot", *kernels_on(on)]
        raise ConfigError(
            f"gmm_impl={backend}: its kernels run on {'/'.join(platforms)}, not on the {on} "
            f"devices of this mesh; valid here: {', '.join(valid)}"
        )
    missing = missing_package(backend)
    if missing:
        raise ConfigError(f"gmm_impl={backend} {missing}")


def gmm(backend, lhs_MD, rhs_EDF, group_sizes_E, group_offset, out_dtype, expected_rows=None):
    """`gmm.gmm`'s contract through the kernels of `backend` (see the module docstring).

    expected_rows: rows per local group under balanced routing, when the caller knows it
    (`tiles.expected_group_rows`): it sizes megablox's row tile and is named in the program
    (`rows~N` scope) for the FLOP count of kernels whose work depends on the group sizes.
    """
    check(backend, platform.current())
    m, e_local = lhs_MD.shape[0], rhs_EDF.shape[0]
    args = (lhs_MD, rhs_EDF, group_sizes_E.astype(jnp.int32))
    offset = jnp.asarray(0 if group_offset is None else group_offset, jnp.int32)
    lhs_MD, rhs_EDF, sizes_E, offset = (varying_like(a, *args, offset) for a in (*args, offset))
    start = jnp.sum(jnp.where(jnp.arange(sizes_E.shape[0]) < offset, sizes_E, 0))
    local_X = jax.lax.dynamic_slice_in_dim(sizes_E, offset, e_local)
    rows = expected_rows if expected_rows is not None else m / max(e_local, 1)
    named = jax.named_scope(scopes.ROWS.label(round(rows))) if expected_rows is not None else None
    with named or contextlib.nullcontext():
        if backend == "megablox":
            blox = Megablox(megablox_row_tile(m, rows), _interpret_mode())
            end = jnp.minimum(start + jnp.sum(local_X), m)
            return _kernel_gmm(blox, lhs_MD, rhs_EDF, sizes_E, offset, start, end, out_dtype)
        kern = Tokamax(TOKAMAX_IMPLEMENTATION[backend], tokamax_row_block(rows))
        end = jnp.minimum(jnp.sum(local_X), m)
        if group_offset is None:
            return _kernel_gmm(kern, lhs_MD, rhs_EDF, local_X, offset, 0, end, out_dtype)
        # tokamax has no group offset: the local groups' rows first, then back in place.
        rolled = jnp.roll(lhs_MD, -start, axis=0)
        out = _kernel_gmm(kern, rolled, rhs_EDF, local_X, offset, 0, end, out_dtype)
        return jnp.roll(out, start, axis=0)


def tokamax_row_block(rows_per_group: float) -> int:
    """The largest row block tokamax's kernels may take for groups of `rows_per_group` rows:
    the expected rows as a power of two, at least TOKAMAX_MIN_ROWS (see Tokamax)."""
    rows = max(1, int(rows_per_group))
    return max(TOKAMAX_MIN_ROWS, 1 << (rows.bit_length() - 1))


def megablox_row_tile(m: int, rows_per_group: float) -> int:
    """megablox's row tile for `m` rows, `rows_per_group` expected (see MEGABLOX_MIN_ROWS)."""
    rows = max(1, int(rows_per_group))
    tm = min(MEGABLOX_MAX_ROWS, max(MEGABLOX_MIN_ROWS, 1 << (rows.bit_length() - 1)))
    return min(tm, max(MEGABLOX_MIN_ROWS, 1 << max(0, (m - 1).bit_length())))


# ---------------------------------------------------------------------------------------------
# The custom VJP shared by the kernel backends.


class _Kernels:
    """A kernel library's two products (hashable: a non-differentiable argument of the VJP).

    gmm(lhs [M, I], rhs, sizes, offset, out_dtype, transpose_rhs) -> [M, Z], rhs [X, I, Z]
    (or [X, Z, I] contracted on its last dim when `transpose_rhs`); rows of group g times
    rhs[g - offset]. tgmm(lhs [M, I], dy [M, Z], sizes, offset, e_local, out_dtype) ->
    [X, I, Z], per local group the sum over its rows of lhs^T dy.
    """

    def gmm(self, lhs, rhs, sizes, offset, out_dtype, transpose_rhs: bool): ...

    def tgmm(self, lhs, dy, sizes, offset, e_local: int, out_dtype): ...


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 7))
def _kernel_gmm(kern, lhs_MI, rhs_XIZ, sizes, offset, start, end, out_dtype):
    return _kernel_fwd(kern, lhs_MI, rhs_XIZ, sizes, offset, start, end, out_dtype)[0]


def _kernel_fwd(kern, lhs_MI, rhs_XIZ, sizes, offset, start, end, out_dtype):
    out_MZ = _unchecked(
        lambda x, w, s, o: kern.gmm(x, w, s, o, out_dtype, False), lhs_MI, rhs_XIZ, sizes, offset
    )
    return _rows_between(out_MZ, start, end), (lhs_MI, rhs_XIZ, sizes, offset, start, end)


def _kernel_bwd(kern, out_dtype, res, dout_MZ):
    lhs_MI, rhs_XIZ, sizes, offset, start, end = res
    dy = dout_MZ.astype(rhs_XIZ.dtype)
    e_local = rhs_XIZ.shape[0]
    dx = _unchecked(
        lambda d, w, s, o: kern.gmm(d, w, s, o, lhs_MI.dtype, True), dy, rhs_XIZ, sizes, offset
    )
    dw = _unchecked(
        lambda x, d, s, o: kern.tgmm(x, d, s, o, e_local, rhs_XIZ.dtype), lhs_MI, dy, sizes, offset
    )
    dx = varying_like(_rows_between(dx, start, end), lhs_MI)
    return dx, varying_like(dw, rhs_XIZ), None, None, None, None


_kernel_gmm.defvjp(_kernel_fwd, _kernel_bwd)


def _rows_between(y, start, end):
    """`y` with the rows outside [start, end) set to zero (the kernels leave them unwritten)."""
    r = jnp.arange(y.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where((r >= start) & (r < end), y, jnp.zeros((), y.dtype))


def _unchecked(fn, *args):
    """`fn(*args)` (one kernel call); inside a `shard_map` that checks vma types, run in a nested
    `shard_map` over no axes without the check (a Pallas call's outputs carry no varying axes),
    its result typed as varying over the operands' axes. A `shard_map` without the check (the
    MoE's under the pipeline, whose stage vmap would split the nested one's operands again over
    the pipeline axis) calls `fn` directly."""
    if not _checks_vma():
        return fn(*args)
    axes = frozenset().union(*(varying_axes(a) for a in args))
    specs = tuple(PartitionSpec() for _ in args)
    inner = jax.shard_map(
        fn, in_specs=specs, out_specs=PartitionSpec(), axis_names=frozenset(), check_vma=False
    )
    return varying_over(inner(*args), axes)


def _checks_vma() -> bool:
    """Whether the code is traced inside a `shard_map` with vma checking: there `axis_index`
    varies over its axis, without the check it has no varying axes (the probe is dead code)."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return bool(manual) and bool(varying_axes(jax.lax.axis_index(manual[0])))


# ---------------------------------------------------------------------------------------------
# The libraries.


@dataclasses.dataclass(frozen=True)
class Tokamax(_Kernels):
    """tokamax's ragged dot with one implementation ("triton" or "mosaic_gpu").

    Its configuration is tokamax's own (its autotuning cache for the GPU and shapes, else its
    heuristics) with the row block capped at `row_block`: each group is covered by whole row
    blocks, so a 128-row block over a group of 16 rows computes 8x its rows (the heuristics'
    Triton block_m is 128, its weight-gradient block_k 32; Mosaic GPU's block_m 64). Mosaic
    GPU's Hopper kernel keeps its block: a warpgroup's MMA takes 64 rows at least.
    `implementation` may also be a callable, which tokamax calls as is (tests' stand-ins).
    """

    implementation: object
    row_block: int = 128

    def gmm(self, lhs, rhs, sizes, offset, out_dtype, transpose_rhs):
        dims = _GMM_T_DIMS if transpose_rhs else _GMM_DIMS
        return self._call(lhs, rhs, sizes, dims, out_dtype)

    def tgmm(self, lhs, dy, sizes, offset, e_local, out_dtype):
        return self._call(lhs, dy, sizes, _TGMM_DIMS, out_dtype)

    def _call(self, lhs, rhs, sizes, dims, out_dtype):
        tokamax = importlib.import_module("tokamax")
        # tokamax reads its options from absl flags and, finding them unparsed, would parse this
        # process's command line (expertax's or pytest's) as absl flags and fail on it.
        flags = importlib.import_module("absl.flags").FLAGS
        if not flags.is_parsed():
            flags.mark_as_parsed()
        with _on_target_device(), _without_cache_miss_warnings():
            try:
                impl = self._op(lhs, rhs, sizes, dims, out_dtype)
                return tokamax.ragged_dot_general(
                    lhs, rhs, sizes, dims, preferred_element_type=out_dtype, implementation=impl
                )
            except NotImplementedError as e:  # e.g. Mosaic GPU kernels on a pre-Hopper GPU
                name = self.implementation
                other = "tokamax_triton or " if name == "mosaic_gpu" else ""
                device = jax.config.jax_default_device or jax.devices()[0]
                raise ConfigError(
                    f"gmm_impl=tokamax_{name}: tokamax refused these operands on "
                    f"{getattr(device, 'device_kind', device)} ({e}); try gmm_impl={other}tiled"
                ) from None

    def _op(self, lhs, rhs, sizes, dims, out_dtype):
        """tokamax's op for `implementation` with its configuration, the row block capped."""
        if not isinstance(self.implementation, str):
            return self.implementation
        op = tokamax_op(self.implementation)
        if self.implementation != "triton":
            return op
        bound = op.bind(
            lhs,
            rhs,
            group_sizes=sizes,
            ragged_dot_dimension_numbers=dims,
            precision=jax.lax.Precision.DEFAULT,
            preferred_element_type=out_dtype,
        )
        config = bound.default_config
        field = "block_m" if dims.rhs_group_dimensions else "block_k"
        block = min(getattr(config, field), self.row_block)
        return op.replace(config=dataclasses.replace(config, **{field: block}))


class _CacheMissFilter(logging.Filter):
    """Drops tokamax's "Autotuning cache miss" warning: a shape its shipped autotuning data does
    not hold gets its heuristics' config, which is what a compile without the GPU (which cannot
    autotune) always uses; the warning repeats the op's whole repr for every kernel call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Autotuning cache miss")


_CACHE_MISS_FILTER = _CacheMissFilter()


@contextlib.contextmanager
def _without_cache_miss_warnings():
    log = logging.getLogger("absl")  # tokamax logs through absl.logging
    log.addFilter(_CACHE_MISS_FILTER)
    try:
        yield
    finally:
        log.removeFilter(_CACHE_MISS_FILTER)


# tokamax's name for its op objects by implementation, the one private name expertax reads.
TOKAMAX_PRIVATE_OPS = ("tokamax._src.ops.ragged_dot.api", "IMPLEMENTATIONS")


def tokamax_op(implementation: str):
    """tokamax's ragged-dot op object for `implementation` ("triton", "mosaic_gpu").

    Why a private name: capping the Triton kernel's row block (`Tokamax`) needs the op object,
    to bind it to the operands, read its default config and replace the block; tokamax's public
    API takes an op object as `implementation` but exports none, and its public route to one
    (`tokamax.autotuning.get_bound_args`) lowers a whole program per call. This is the one place
    expertax reads it; tests/unit/nn/moe/test_gmm_kernels.py fails when it moves."""
    module, name = TOKAMAX_PRIVATE_OPS
    return getattr(importlib.import_module(module), name)[implementation]


def _on_target_device():
    """JAX's default device set to the traced-for GPU when the process's default is not one
    (a compile for a GPU target from a CPU machine); otherwise nothing changes."""
    target = platform.device()
    default = jax.config.jax_default_device or jax.devices()[0]
    if target is None or platform.normalize(getattr(default, "platform", "")) == "gpu":
        return contextlib.nullcontext()
    return jax.default_device(target)


@dataclasses.dataclass(frozen=True)
class Megablox(_Kernels):
    """JAX's megablox grouped matmuls (Pallas Mosaic TPU): row tile `tm`; K and N tiles of
    MEGABLOX_MAX_KN or the whole dim."""

    tm: int
    interpret: object = False  # or Pallas TPU's InterpretParams

    def _tiling(self, k: int, n: int) -> tuple[int, int, int]:
        return self.tm, min(k, MEGABLOX_MAX_KN), min(n, MEGABLOX_MAX_KN)

    def gmm(self, lhs, rhs, sizes, offset, out_dtype, transpose_rhs):
        m, k = lhs.shape
        n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
        with _one_pass_for_16_bits(lhs):
            out = self._gmm(lhs, rhs, sizes, offset, out_dtype, transpose_rhs, k, n)
        return out[:m]

    def _gmm(self, lhs, rhs, sizes, offset, out_dtype, transpose_rhs, k, n):
        return _megablox().gmm(
            _pad_rows(lhs, self.tm),
            rhs,
            sizes,
            out_dtype,
            self._tiling(k, n),
            offset,
            transpose_rhs=transpose_rhs,
            interpret=self.interpret,
        )

    def tgmm(self, lhs, dy, sizes, offset, e_local, out_dtype):
        with _one_pass_for_16_bits(lhs):
            return _megablox().tgmm(
                _pad_rows(lhs, self.tm).T,
                _pad_rows(dy, self.tm),
                sizes,
                out_dtype,
                self._tiling(lhs.shape[1], dy.shape[1]),
                offset,
                e_local,
                interpret=self.interpret,
            )


def _one_pass_for_16_bits(x):
    """The default matmul precision for 16-bit operands: their products are exact in one MXU
    pass, and Mosaic refuses the multi-pass float32 contraction a global `highest` asks for."""
    if jnp.dtype(x.dtype).itemsize > 2:
        return contextlib.nullcontext()
    return jax.default_matmul_precision("default")


def _megablox():
    # The package's __init__ rebinds the name `gmm` to the differentiable op; the kernels
    # (gmm, tgmm without a VJP) live in the module of that name.
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _pad_rows(x, multiple: int):
    pad = -x.shape[0] % multiple
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x
