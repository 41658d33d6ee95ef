"""What the Hopper kernels share: shared-memory tiling, one `wgmma` into a fresh float32
accumulator, scale vectors, the zero accumulator and the store through TMA.

The interpreter (`interpret=True`: Pallas's Mosaic GPU interpreter on CPU, jax 0.10.2) cannot
read a transposed shared-memory view in `wgmma` (it accepts only index transforms there), nor run
`plgpu.load` or `plgpu.layout_cast`; interpreted, the kernel takes the weight [G, K, N] (the
contraction first: tiles used as they are), reads the row scales through a plain ref read and
starts from an unlaid-out zero. Everything else (the schedule, the TMA pipeline, `wgmma` into a
float32 accumulator, the promotion, the stores) is the code the GPU runs. The interpreter
multiplies e4m3 in NumPy with float32 results, not bit for bit the tensor cores' accumulation
order.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from expertax.fp8 import kernel
from expertax.fp8.hopper.layout import TILE


def interpreter():
    """Pallas's Mosaic GPU interpreter parameters (fp8/kernel.py's `INTERPRETER`)."""
    return kernel.interpreter()


def transforms(dtype, minor: int = TILE):
    """The shared-memory tiling and swizzle of a block whose minor dim holds `minor` values:
    the largest swizzle its rows take (128 bytes for 128 e4m3 values, 64 for 64)."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def mma(a_smem, b_smem, shape, interpret):
    """A fresh float32 product of two e4m3 tiles in shared memory, `shape` [rows, columns] (64
    or 128 by 64 or 128), one `wgmma`: `a` [rows, contraction]; `b` [columns, contraction]
    (K-major, read through its transposed view) on the GPU, [contraction, columns]
    interpreted."""
    b_tile = b_smem if interpret else plgpu.transpose_ref(b_smem, (1, 0))

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_tile)
        return acc_ref[...]

    return pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))


def vector(smem, layout, interpret):
    """The float32 scales of a [1, 64 or 128] shared-memory block in registers, laid out to
    broadcast along a WGMMA tile's rows or columns (interpreted: a plain ref read)."""
    return smem[0, :] if interpret else plgpu.load(smem.at[0], (), layout=layout)


def zero(shape, interpret):
    """A zero float32 accumulator of `shape` in the WGMMA layout (interpreted: unlaid-out)."""
    zero = jnp.zeros(shape, jnp.float32)
    return zero if interpret else plgpu.layout_cast(zero, plgpu.Layout.WGMMA)


def store(acc, out_gmem):
    """The tile `acc` ([64 or 128, 64 or 128]) into the tile `out_gmem` of global memory (its
    shape, in its dtype), through shared memory and TMA."""
    dtype = out_gmem.dtype

    @functools.partial(
        pl.run_scoped,
        out_smem=plgpu.SMEM(acc.shape, dtype, transforms=transforms(dtype, acc.shape[1])),
    )
    def _(out_smem):
        out_smem[...] = acc.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem)
        plgpu.wait_smem_to_gmem(0)
