"""MXFP4 dequantization (convert/mxfp4.py) against the format's definition, written here from
OCP MX v1.0 (e2m1: sign, 2 exponent bits with bias 1, 1 mantissa bit; e8m0: 2^(s - 127)), and
against transformers' own dequantizer; the checks of quantization_config and of bad scales."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from expertax.convert import ConversionError, config_from_hf, mxfp4

BF16 = np.dtype(ml_dtypes.bfloat16)
# Every scale class: the smallest (2^-127, a float32 subnormal), around 1, the largest (2^127:
# 6 * 2^127 overflows to inf in every target dtype).
SCALES = (0, 1, 2, 100, 126, 127, 128, 140, 253, 254)


def reference(blocks: np.ndarray, scales: np.ndarray, dtype) -> np.ndarray:
    """Element by element from the bit fields, in Python floats, rounded once to `dtype`."""

    def e2m1(code: int) -> float:
        sign = -1.0 if code & 0b1000 else 1.0
        exponent, mantissa = (code >> 1) & 0b11, code & 1
        if exponent == 0:  # subnormal: 0.M x 2^(1 - bias)
            return sign * mantissa * 0.5
        return sign * (1.0 + mantissa / 2) * 2.0 ** (exponent - 1)

    out = np.zeros((*scales.shape, 32), np.float64)
    for idx in np.ndindex(scales.shape):
        for k, byte in enumerate(blocks[idx]):
            for nibble, code in enumerate((int(byte) & 0xF, int(byte) >> 4)):  # low first
                try:
                    out[(*idx, 2 * k + nibble)] = math.ldexp(e2m1(code), int(scales[idx]) - 127)
                except OverflowError:
                    out[(*idx, 2 * k + nibble)] = math.copysign(math.inf, e2m1(code))
    with np.errstate(over="ignore"):
        return out.reshape(*scales.shape[:-1], -1).astype(dtype)


def _every_code_and_scale() -> tuple[np.ndarray, np.ndarray]:
    """[S, 8, 16] blocks holding all 256 bytes (so every code as low and as high nibble) under
    each scale of SCALES."""
    block = np.arange(256, dtype=np.uint8).reshape(16, 16)
    blocks = np.broadcast_to(block, (len(SCALES), 16, 16)).copy()
    scales = np.broadcast_to(np.array(SCALES, np.uint8)[:, None], (len(SCALES), 16)).copy()
    return blocks, scales


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
def test_every_code_and_scale_matches_the_definition(dtype, monkeypatch):
    blocks, scales = _every_code_and_scale()
    got = mxfp4.dequantize(blocks, scales, dtype)
    want = reference(blocks, scales, dtype)
    monkeypatch.setattr(mxfp4, "_STEP", 7)  # 160 blocks in steps of 7, the last partial
    assert np.array_equal(
        mxfp4.dequantize(blocks, scales, dtype).view(np.uint8), got.view(np.uint8)
    )
    assert got.shape == (len(SCALES), 16 * 32) and got.dtype == np.dtype(dtype)
    bits = f"u{np.dtype(dtype).itemsize}"
    assert np.array_equal(got.view(bits), want.view(bits))  # bit for bit: -0.0, inf included
    assert got[SCALES.index(127), :16].astype(np.float32).tolist() == [
        0.0, 0, 0.5, 0, 1.0, 0, 1.5, 0, 2.0, 0, 3.0, 0, 4.0, 0, 6.0, 0
    ]  # bytes 0..7: their low nibble (codes 0..7) first, then the high one (0)  # fmt: skip
    assert np.isinf(got[SCALES.index(254)].astype(np.float32)).any()
    assert (got[SCALES.index(0)].astype(np.float32)[2] == 2.0**-128) == (dtype != np.float16)
    # control: high and low nibbles swapped give other values
    swapped = (blocks << 4) | (blocks >> 4)
    assert not np.array_equal(mxfp4.dequantize(swapped, scales, dtype).view(bits), want.view(bits))


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_transposed_dequantization_is_the_transpose_bit_for_bit(dtype, monkeypatch):
    """dequantize_transposed (the converter's path) = dequantize's last two axes swapped, for
    every byte under every scale class, on whole and on every-other-row (strided) inputs, with
    lookups split into steps that leave a partial last one."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 6, 5, 16), dtype=np.uint8)  # [E, R, G, 16]
    blocks[0, :, :, :].reshape(-1)[:256] = np.arange(256)
    scales = rng.choice(np.array(SCALES, np.uint8), (2, 6, 5))
    bits = f"u{np.dtype(dtype).itemsize}"
    monkeypatch.setattr(mxfp4, "_STEP", 13)  # 2 scale rows of 6 per lookup: 5 = 2 + 2 + 1
    for rows in (slice(None), slice(0, None, 2), slice(1, None, 2)):
        want = mxfp4.dequantize(blocks[:, rows], scales[:, rows], dtype).swapaxes(1, 2)
        got = mxfp4.dequantize_transposed(blocks[:, rows], scales[:, rows], dtype)
        assert got.shape == want.shape and got.flags.c_contiguous
        assert np.array_equal(got.view(bits), want.view(bits))
    with pytest.raises(ConversionError, match="scale 255"):
        mxfp4.dequantize_transposed(blocks, np.full_like(scales, 255), dtype, "w")


def test_nan_scale_and_bad_shapes_are_refused():
    blocks, scales = _every_code_and_scale()
    scales[3, 5] = 255
    with pytest.raises(ConversionError, match=r"w_scales: scale 255 \(NaN in e8m0\) at \[3, 5\]"):
        mxfp4.dequantize(blocks, scales, np.float32, "w")
    with pytest.raises(ConversionError, match="need scales of shape"):
        mxfp4.dequantize(blocks, scales[:, :4], np.float32, "w")
    with pytest.raises(ConversionError, match="not a multiple of 32"):
        mxfp4.stored_shapes((2, 4, 40), "model.layers.0.mlp.experts.down_proj")


@pytest.mark.parity
def test_matches_transformers_dequantizer():
    torch = pytest.importorskip("torch")
    packed = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 10, 4, 16), np.uint8)
    scales = rng.integers(90, 160, (3, 10, 4), np.uint8)
    for dtype, torch_dtype in ((BF16, torch.bfloat16), (np.float32, torch.float32)):
        want = packed.convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch_dtype
        )  # [E, in, out]: transformers' in-memory layout
        got = mxfp4.dequantize(blocks, scales, dtype).transpose(0, 2, 1)
        assert np.array_equal(got.astype(np.float32), want.float().numpy())


def test_quantization_config_is_checked_naming_the_field():
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"], "dequantize": False}
    assert mxfp4.quantization_format(qc) == "mxfp4"
    assert mxfp4.quantization_format(None) == ""
    with pytest.raises(ConversionError, match=r"quantization_config.group_size=32"):
        mxfp4.quantization_format({**qc, "group_size": 32})
    with pytest.raises(ConversionError, match="modules_to_not_convert"):
        mxfp4.quantization_format({**qc, "modules_to_not_convert": "lm_head"})
    mixtral = {"model_type": "mixtral", "quantization_config": qc}
    with pytest.raises(ConversionError, match="quant_method='mxfp4' with model_type='mixtral'"):
        config_from_hf(mixtral)
