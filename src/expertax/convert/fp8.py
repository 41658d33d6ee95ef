"""DeepSeek-V3's fp8 weight format: e4m3 values with one float32 scale per 128 x 128 block.

The hub checkpoint stores each quantized `[out, in]` weight `W` as `W_q` (float8_e4m3fn) and
`W_scale_inv` (float32, `[ceil(out / 128), ceil(in / 128)]`, blocks at the edges partial);
the weight is `W_q * W_scale_inv` broadcast over each block (DeepSeek's `weight_dequant`).
Everything else (embeddings, norms, the router, `e_score_correction_bias`) stays bfloat16/float32.
The e4m3 type, its range and the block scale rule are fp8/quant.py's, shared with decoding and
training; this module holds the hub's format: its config, names, 128 x 128 grids, and the
streaming (numpy) conversion of checkpoints larger than memory.
"""

from __future__ import annotations

import numpy as np

from expertax.convert.errors import ConversionError
from expertax.fp8 import quant

FP8 = np.dtype(quant.E4M3)
BLOCK = quant.BLOCK
SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
# The quantization_config DeepSeek-V3 publishes; every field must have one of these values.
ACCEPTED: dict[str, tuple] = {
    "quant_method": ("fp8",),
    "fmt": ("e4m3",),
    "weight_block_size": ([BLOCK, BLOCK],),
    "activation_scheme": ("dynamic",),  # how inference quantizes activations; weights unaffected
}
HUB_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
}


def check_quantization_config(qc: object) -> bool:
    """Whether `qc` (config.json's `quantization_config`) declares fp8 weights; ConversionError
    naming the field, its value and the accepted values for anything else."""
    if not qc:
        return False
    if not isinstance(qc, dict):
        raise ConversionError(f"HF config field quantization_config={qc!r} is not a mapping")
    for key, value in qc.items():
        if key not in ACCEPTED:
            raise ConversionError(
                f"HF config field quantization_config.{key}={value!r} is not supported; "
                f"supported fields: {', '.join(ACCEPTED)} (DeepSeek-V3's fp8 block format)"
            )
        if value not in ACCEPTED[key]:
            raise ConversionError(
                f"HF config field quantization_config.{key}={value!r} is not supported "
                f"(supported: {', '.join(repr(v) for v in ACCEPTED[key])})"
            )
    for key in ("quant_method", "fmt", "weight_block_size"):
        if key not in qc:
            raise ConversionError(
                f"HF config field quantization_config.{key} is missing; DeepSeek-V3's fp8 format "
                f"is {HUB_QUANTIZATION_CONFIG}"
            )
    return True


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    out, inp = shape
    return (-(-out // BLOCK), -(-inp // BLOCK))


def _tables() -> tuple[np.ndarray, np.ndarray]:
    """e4m3 -> float32 lookup tables: by byte, and by pairs of bytes (a little-endian uint16,
    the first byte's value in the low half of a uint64), from ml_dtypes' own conversion."""
    by_byte = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)
    pair = np.arange(2**16, dtype=np.uint32)
    by_pair = np.stack([by_byte[pair & 0xFF], by_byte[pair >> 8]], axis=1)
    return by_byte, by_pair.view(np.uint64).reshape(-1)


_BY_BYTE, _BY_PAIR = _tables()


def to_float32(w_q: np.ndarray) -> np.ndarray:
    """`w_q.astype(float32)`, exactly (NaN included), by table lookup: ml_dtypes' cast runs at
    about 0.15 GiB/s of fp8 on our machine, one lookup per two values at about 0.6 GiB/s."""
    flat = np.ascontiguousarray(w_q).reshape(-1).view(np.uint8)
    if flat.size % 2:
        return _BY_BYTE[flat].reshape(w_q.shape)
    return _BY_PAIR[flat.view(np.uint16)].view(np.float32).reshape(w_q.shape)


def dequantize(w_q: np.ndarray, scale_inv: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`w_q * scale_inv` per 128 x 128 block, computed in float32 and rounded once to `dtype`.

    `w_q` may be a block of rows of the weight that starts at a multiple of 128; `scale_inv` is
    then the matching rows of the scale grid. Works through 128 rows at a time, so the float32
    temporaries stay small beside the output.
    """
    rows, cols = w_q.shape
    if scale_inv.shape != scale_shape(w_q.shape):
        raise ConversionError(
            f"fp8 scale grid has shape {scale_inv.shape}; a weight of shape {w_q.shape} in "
            f"{BLOCK} x {BLOCK} blocks needs {scale_shape(w_q.shape)}"
        )
    out = np.empty((rows, cols), dtype)
    scale = scale_inv.astype(np.float32)
    for r in range(0, rows, BLOCK):
        block = to_float32(w_q[r : r + BLOCK])
        block *= np.repeat(scale[r // BLOCK], BLOCK)[:cols]  # one scale row, all 128 rows
        out[r : r + BLOCK] = block
    return out


def quantize(w: np.ndarray, hint: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(w_q, scale_inv) of a [out, in] weight in DeepSeek's block format.

    Each block's scale is `hint`'s (the scale the weight was read with, when it came from an fp8
    checkpoint) if the block still fits in e4m3 with it, else `amax / 448`. With the hint, a
    weight dequantized from fp8 requantizes to the same bytes: `dequantize` rounds `q * s` to
    bfloat16/float32 (relative error <= 2^-9), far inside half an e4m3 step (2^-4), so
    `round(w / s)` is `q` again.
    """
    amax = quant.block_amax(w, BLOCK, BLOCK, np)
    scale = quant.scale_for(amax, np)
    if hint is not None:
        hint = hint.astype(np.float32)
        fits = (hint > 0) & (amax <= np.float32(quant.E4M3_MAX) * hint)
        scale = np.where(fits, hint, scale)
    return quant.quantize_blocks(w, BLOCK, BLOCK, np, scale_GH=scale)
