"""Where the fp8 recipe's products run: Hopper's fp8 tensor cores (fp8/hopper/'s kernels,
imported only where a product is assigned to them) or dequantized in the operands' dtype; and
the refusals of `gmm_impl=fp8_hopper` where it cannot run (`check`: from the config alone;
`routed_choice`: on the mesh's devices).

The kernel multiplies e4m3 tiles with `wgmma` (sm_90a: H100, H200) and promotes each K step's
float32 partial by the operands' scales (DeepSeek-V3's block-scaled GEMM): steps and output
tiles of the recipe's 128, or 64 along a dim that is a multiple of 64 and not of 128 (`wgmma`
takes N in multiples of 8 and K in steps of 32; the step still takes its 128-block's scale). It
takes a product when the program is traced for a Hopper GPU and the product's K and N (the
contraction and the output width) are multiples of 64 (`NARROW`):
- the routed experts (`fp8/matmul.py`, config key `gmm_impl`): `fp8_hopper` runs their fprop,
  dgrad and wgrad on it under either recipe (tensorwise scales broadcast to the block grids),
  `auto` picks it under a `quantization` on a Hopper mesh, from the evidence below, where the
  dims fit (D and the local F; otherwise `auto` keeps the dequantized products on its backend);
- the dense linears (`fp8/matmul.py`: attention projections, dense MLPs, shared experts) under
  `fp8_blockwise`: all three products as one group, each linear whose K and N fit (DeepSeek-V3's
  MLA wkv_a, 7168 -> 576 = 4.5 x 128, runs unpadded in 64-wide tiles along N) or whose
  zero-padding to multiples of 64 adds at most a quarter (`PAD_LIMIT`; the padded e4m3 values
  are zeros, so the product is the unpadded one's); the others dequantized. `fp8_tensorwise`
  stays on cuBLASLt's fp8 GEMM (XLA's rewrite of a scalar-scaled dot), which needs no kernel of
  ours.

Why `auto` picks it on Hopper (compiled for `gpu:h100x8`, not run: docs/design/fp8.md): its PTX
multiplies e4m3 by e4m3 into float32 (`wgmma.mma_async ... f32.e4m3.e4m3`,
tests/unit/nn/moe/test_fp8_hopper.py), where the bfloat16 backend `auto` picks on a GPU
(tokamax's Triton grouped GEMM) converts the dequantized operands to f16 for `mma.sync`: fp8's
bytes without its tensor cores. Elsewhere (TPU, CPU, pre-Hopper and later GPUs) `auto` is what
it is without fp8.

`interpret()`: a CPU stands in for a Hopper GPU, the kernel running in Pallas's Mosaic GPU
interpreter (tests only: seconds per product at test sizes).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Any

import jax

from expertax import platform
from expertax.errors import ConfigError
from expertax.fp8 import quant
from expertax.fp8.recipes import RECIPES

if TYPE_CHECKING:
    from expertax.config.schema import Config

HOPPER = "fp8_hopper"  # the `gmm_impl` value
TILE = quant.BLOCK  # the kernel's row, column and K tile: the recipe's block (128)
# its column tile and K step along dims that are multiples of 64 but not of 128 (MLA's wkv_a,
# 576 wide): `wgmma` takes N in multiples of 8 and K in steps of 32, so 64 is as native as 128;
# a 128 x 128 scale block then covers two tiles or steps (fp8/hopper/layout.tile_for)
NARROW = 64
# XLA:GPU's Triton GEMM emitter claims a dot before the cuBLASLt fp8 rewrite sees it (jax 0.10.2):
# a program of fp8 GEMMs compiles with it off.
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
# Pallas's Mosaic GPU interpreter: its parameters object (`InterpretGPUParams`), which jax
# 0.10.2 does not export from a public module, so the library never imports it: whoever runs
# the kernels interpreted sets it (tests/conftest.py). None: no interpreter.
INTERPRETER: Any = None
_INTERPRET: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8_interpret", default=False)


@contextlib.contextmanager
def interpret():
    """Inside, a CPU stands in for a Hopper GPU: the products `hopper()` assigns to the kernel
    run in Pallas's Mosaic GPU interpreter (tests)."""
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def is_hopper(device) -> bool:
    """Whether `device` is a Hopper GPU (compute capability 9.x: H100, H200): the generation
    with `wgmma` (Blackwell's tensor cores take other instructions)."""
    capability = str(getattr(device, "compute_capability", "") or "")
    return capability.split(".")[0] == "9"


def hopper(on: str | None = None, device=None) -> bool:
    """Whether programs traced now run the kernel: for a Hopper GPU (`on`, `device`: default the
    platform traced for, `expertax.platform`), or for a CPU inside `interpret()`."""
    on = on or platform.current()
    if on == "cpu":
        return _INTERPRET.get()
    if on != "gpu":
        return False
    device = device or platform.device()
    if device is None:  # traced outside a trainer's context: a GPU machine's own devices
        devices = jax.devices()
        device = devices[0] if platform.of_devices(devices) == "gpu" else None
    return device is not None and is_hopper(device)


def interpreting() -> bool:
    """The kernel in Pallas's interpreter: the program is traced for a CPU."""
    return platform.current() == "cpu"


def interpreter():
    """`INTERPRETER`, which running the kernels interpreted needs."""
    if INTERPRETER is None:
        raise RuntimeError(
            "fp8.kernel: running the kernels interpreted needs Pallas's Mosaic GPU interpreter "
            "parameters, which jax 0.10.2 does not export: set fp8.kernel.INTERPRETER to an "
            "InterpretGPUParams (tests/conftest.py does); on a Hopper GPU nothing is needed"
        )
    return INTERPRETER


def fits(*dims: int) -> bool:
    """Whether each dim (a product's K and N) is a whole number of the kernel's narrowest tile
    (64: 128 where the dim allows, `hopper.layout.tile_for`)."""
    return all(d > 0 and d % NARROW == 0 for d in dims)


# How much a dense linear's K x N may grow by its zero-padding to multiples of 64 and still run
# on the kernel (`dense`)
PAD_LIMIT = 1.25


def padded(d: int) -> int:
    """`d` rounded up to a multiple of 64, the narrowest tile: itself where it is one (576 for
    MLA's wkv_a), so only dims that are not multiples of 64 are zero-padded."""
    return -(-d // NARROW) * NARROW


def dense(recipe: str, k: int, n: int) -> bool:
    """Whether a dense linear [M, K] x [K, N] under `recipe` runs its products on the kernel
    (the module docstring): K and N multiples of 64, or padded to them by at most
    `PAD_LIMIT`."""
    grows = padded(k) * padded(n) <= PAD_LIMIT * k * n
    return recipe == "fp8_blockwise" and k > 0 and n > 0 and grows and hopper()


def routed(gmm_impl: str, recipe: str, k: int, n: int) -> str:
    """The backend of the routed experts' fp8 products [M, K] x [E, K, N] (local shapes):
    `auto` is `HOPPER` where `dense`'s conditions hold for either recipe, else `gmm_impl`."""
    if gmm_impl == "auto" and recipe in RECIPES and fits(k, n) and hopper():
        return HOPPER
    return gmm_impl


def routed_choice(
    gmm_impl: str, recipe: str, on: str, device, d: int, f_local: int
) -> tuple[str, str]:
    """(the routed experts' fp8 backend on a mesh of `on` devices (`device`: one of them), why)
    for experts of width D = `d` and a local MLP dim `f_local` (F over its shards); a
    ConfigError, before any compilation, where `gmm_impl=fp8_hopper` cannot run there."""
    if gmm_impl != HOPPER and (gmm_impl != "auto" or recipe not in RECIPES):
        return gmm_impl, f"gmm_impl={gmm_impl}"
    kind = getattr(device, "device_kind", on)
    if not hopper(on, device):
        if gmm_impl == HOPPER:
            raise ConfigError(
                f"gmm_impl={HOPPER}: its kernel multiplies e4m3 with Hopper's wgmma (H100, H200: "
                f"gpu:h100x*, gpu:h200x* targets), not on the {kind} devices of this mesh; use "
                "gmm_impl=auto (the dequantized products on this platform's backend)"
            )
        return gmm_impl, f"gmm_impl=auto: not a Hopper GPU ({kind}): dequantized products"
    if not fits(d, f_local):
        if gmm_impl == HOPPER:
            raise ConfigError(
                f"gmm_impl={HOPPER}: its kernel takes tiles of {TILE} or {NARROW}; the experts' "
                f"D (base_emb_dim={d}) and MLP dim per shard (F={f_local}) must be multiples of "
                f"{NARROW}; use gmm_impl=auto (dequantized products for these dims)"
            )
        return gmm_impl, (
            f"gmm_impl=auto: D={d} or F per shard={f_local} is not a multiple of {NARROW}: "
            "dequantized products"
        )
    return HOPPER, f"gmm_impl={gmm_impl}: fprop, dgrad and wgrad on the {HOPPER} kernels ({kind})"


def check(c: Config) -> None:
    """ConfigError, from the config alone, where `gmm_impl=fp8_hopper` cannot run: it multiplies
    fp8 operands in tiles of 128 or 64 along K and N, so it needs a recipe and dims of whole
    64-tiles (the devices and the split of F: `routed_choice`, once the mesh is known)."""
    if c.gmm_impl != HOPPER:
        return
    if not c.quantization:
        raise ConfigError(
            f"gmm_impl={HOPPER} multiplies e4m3 operands: it needs quantization="
            "fp8_blockwise or fp8_tensorwise (got quantization=''); without quantization use "
            "auto, tiled, ragged_dot, tokamax_triton, tokamax_mosaic_gpu or megablox"
        )
    d, f, t = c.base_emb_dim, c.base_moe_mlp_dim, NARROW
    if c.is_moe and (d % t or f % t):
        raise ConfigError(
            f"gmm_impl={HOPPER}: its kernel takes tiles of 128 or {t}; base_emb_dim={d} and "
            f"base_moe_mlp_dim={f} must be multiples of {t}; use gmm_impl=auto (dequantized "
            "products for these dims)"
        )
