"""MXFP4, the expert weight format of GPT-OSS's hub checkpoints (OCP Microscaling, MX v1.0).

Each routed-expert weight `W` ([E, R, C] as stored: `gate_up_proj` [E, 2F, D], `down_proj`
[E, D, F], the transpose of transformers' in-memory layout) is held as
- `W_blocks`: uint8 [E, R, C / 32, 16], one block of 32 e2m1 values per 16 bytes, two 4-bit
  codes per byte, the low nibble first (element 2k in bits 0-3, element 2k + 1 in bits 4-7);
- `W_scales`: uint8 [E, R, C / 32], one e8m0 scale per block: the power of two 2^(s - 127);
  s = 255 is NaN in the format (a corrupt checkpoint here: refused).
An e2m1 code is sign (bit 3), two exponent bits and one mantissa bit, bias 1: the magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6. A value is code * 2^(s - 127), exact in float64 and rounded once to
the model's dtype (exact in bfloat16 and float32 but for overflow past 2^128, which becomes inf).

Everything else (attention, router, embeddings, the expert biases) stays bfloat16. The
dequantization is one table lookup per byte: (scale, byte) -> the byte's two values in the
target dtype, a 65,536-entry table built once per dtype from the definition above.
`dequantize_transposed` writes each weight's transpose (our [in, out] layout) straight from the
lookups: it transposes the packed bytes (a quarter of the output's bytes) instead of the
dequantized values, which made the converter's bfloat16 transposes its largest cost.
"""

from __future__ import annotations

import functools

import numpy as np

from expertax.convert import fp8
from expertax.convert.errors import ConversionError
from expertax.convert.hf import transpose

QUANT_METHOD = "mxfp4"
BLOCK = 32  # values per scale
BLOCK_BYTES = BLOCK // 2
SCALE_BIAS = 127
NAN_SCALE = 255
BLOCKS, SCALES = "_blocks", "_scales"  # "…experts.down_proj" -> "…experts.down_proj_blocks"
_STEP = 2**16  # blocks per lookup step (1 MiB of codes; ~2x numpy's fancy indexing at once)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; code | 8: negative
# transformers' Mxfp4Config fields; the tensors' names, not modules_to_not_convert, decide what
# is read as MXFP4. `dequantize` is a loading option of transformers.
ACCEPTED = ("quant_method", "modules_to_not_convert", "dequantize")


def quantization_format(qc: object) -> str:
    """ "", "fp8" or "mxfp4": the format config.json's `quantization_config` declares, checked
    (ConversionError naming the field, its value and what is accepted)."""
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        return "fp8" if fp8.check_quantization_config(qc) else ""
    for key, value in qc.items():
        if key not in ACCEPTED:
            raise ConversionError(
                f"HF config field quantization_config.{key}={value!r} is not supported with "
                f"quant_method=mxfp4; supported fields: {', '.join(ACCEPTED)}"
            )
    skip = qc.get("modules_to_not_convert")
    if skip is not None and not (isinstance(skip, list) and all(isinstance(s, str) for s in skip)):
        raise ConversionError(
            f"HF config field quantization_config.modules_to_not_convert={skip!r} must be a list "
            "of module names"
        )
    return QUANT_METHOD


def stored_shapes(shape: tuple[int, int, int], name: str) -> tuple[tuple, tuple]:
    """(blocks shape, scales shape) of an [E, R, C] weight; C must be a multiple of 32."""
    e, r, c = shape
    if c % BLOCK:
        raise ConversionError(
            f"tensor {name}{BLOCKS}: MXFP4 packs the last axis in blocks of {BLOCK}; the config "
            f"implies {c} values per row, not a multiple of {BLOCK}"
        )
    return (e, r, c // BLOCK, BLOCK_BYTES), (e, r, c // BLOCK)


def value(code: int) -> float:
    """The e2m1 value of a 4-bit code, from the format's bit fields."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


@functools.cache
def _table(dtype: np.dtype) -> np.ndarray:
    """(scale << 8 | byte) -> the byte's two values (low nibble first) in `dtype`, as one
    unsigned integer of twice the itemsize; scale 255 (NaN) gives NaN."""
    codes = np.arange(256)
    lo = np.array([value(c) for c in range(16)])[codes & 15]
    hi = np.array([value(c) for c in range(16)])[codes >> 4]
    scale = np.ldexp(1.0, np.arange(256) - SCALE_BIAS)
    scale[NAN_SCALE] = np.nan
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf in every dtype we convert into
        pairs = np.stack([scale[:, None] * lo, scale[:, None] * hi], axis=-1).astype(dtype)
    return pairs.view(f"u{2 * dtype.itemsize}").reshape(-1)


def _check(blocks: np.ndarray, scales: np.ndarray, name: str) -> None:
    """ConversionError for mismatched shapes and for a NaN scale (255), naming `name` and the
    block."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ConversionError(
            f"tensor {name}: MXFP4 blocks and scales are uint8, got {blocks.dtype} and "
            f"{scales.dtype}"
        )
    if blocks.shape != (*scales.shape, BLOCK_BYTES):
        raise ConversionError(
            f"tensor {name}: MXFP4 blocks of shape {blocks.shape} need scales of shape "
            f"{blocks.shape[:-1]} (one per {BLOCK_BYTES} bytes), got {scales.shape}"
        )
    nan = scales == NAN_SCALE
    if nan.any():
        where = [int(x) for x in np.argwhere(nan)[0]]
        raise ConversionError(
            f"tensor {name}{SCALES}: scale {NAN_SCALE} (NaN in e8m0) at {where}, "
            f"{int(nan.sum())} blocks in all; a checkpoint's scales are 0..254"
        )


def dequantize(
    blocks: np.ndarray, scales: np.ndarray, dtype: np.dtype, name: str = ""
) -> np.ndarray:
    """[..., G, 16] blocks and [..., G] scales -> the [..., G * 32] values in `dtype`.

    ConversionError for mismatched shapes and for a NaN scale (255), naming `name` and the
    block."""
    dtype = np.dtype(dtype)
    _check(blocks, scales, name)
    table, rows = _table(dtype), blocks.reshape(-1, BLOCK_BYTES)
    out = np.empty(rows.shape, table.dtype)
    flat_scales = scales.reshape(-1)
    for a in range(0, len(rows), _STEP):  # small temporaries; `take` without bounds checks
        index = (flat_scales[a : a + _STEP].astype(np.uint16) << 8)[:, None] | rows[a : a + _STEP]
        np.take(table, index, out=out[a : a + _STEP], mode="clip")  # every index is in range
    return out.view(dtype).reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK)


def dequantize_transposed(
    blocks: np.ndarray, scales: np.ndarray, dtype: np.dtype, name: str = ""
) -> np.ndarray:
    """[..., R, G, 16] blocks and [..., R, G] scales -> the transposed values [..., G * 32, R]
    in `dtype`: `dequantize(...)` with its last two axes swapped, bit for bit.

    The bytes are transposed first ([R, C / 2] -> [C / 2, R], one byte per two values); a
    lookup then gives row k of that the values of output rows 2k (low nibbles) and 2k + 1 (high
    nibbles) as pairs, which are split into the two rows. Works on strided `blocks` (e.g. every
    other row)."""
    dtype = np.dtype(dtype)
    _check(blocks, scales, name)
    table = _table(dtype)
    *lead, r, g, _ = blocks.shape
    bits = f"u{dtype.itemsize}"
    out = np.empty((*lead, g * BLOCK, r), dtype)
    flat_out = out.reshape(-1, g * BLOCK, r).view(bits)
    flat_blocks = blocks.reshape(-1, r, g, BLOCK_BYTES)
    flat_scales = scales.reshape(-1, r, g)
    step = max(1, _STEP // r)  # scale rows (16 byte rows each) per lookup
    for i in range(len(flat_out)):
        codes = transpose(flat_blocks[i].reshape(r, g * BLOCK_BYTES))  # [C / 2, R]
        shifted = transpose(flat_scales[i]).astype(np.uint16) << 8  # [G, R]
        pairs = np.empty((step, BLOCK_BYTES, r), table.dtype)
        for a in range(0, g, step):
            n = min(step, g - a)
            rows_of = codes[a * BLOCK_BYTES : (a + n) * BLOCK_BYTES].reshape(n, BLOCK_BYTES, r)
            np.take(table, shifted[a : a + n, None, :] | rows_of, out=pairs[:n], mode="clip")
            both = pairs[:n].view(bits).reshape(n * BLOCK_BYTES, r, 2)
            rows = flat_out[i, a * BLOCK : (a + n) * BLOCK].reshape(n * BLOCK_BYTES, 2, r)
            rows[:, 0], rows[:, 1] = both[..., 0], both[..., 1]
    return out
