"""Rotary position embeddings: plain RoPE and YaRN (with its amplitude and softmax corrections).

Rotation uses the half-split convention (first half of the rotary dims paired with the second
half), as HuggingFace's Llama/Mixtral do; checkpoints with an interleaved layout (DeepSeek-V3)
are permuted once at conversion. YaRN follows Peng et al. 2023 ("YaRN: Efficient Context Window
Extension"), Sec. 3.2-3.4, as DeepSeek-V3 uses it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from expertax.config.schema import Config


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """Amplitude correction 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inverse_frequencies(c: Config, dim: int) -> tuple[jax.Array, float]:
    """Inverse frequencies [dim/2] (float32) and the cos/sin amplitude factor."""
    base = c.rope_max_timescale
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    extrapolation = 1.0 / (base**exponents)
    if c.rope_type != "yarn":
        return extrapolation, 1.0
    interpolation = extrapolation / c.rope_factor
    orig = c.original_max_position_embeddings
    low: float = _correction_dim(c.beta_fast, dim, base, orig)
    high: float = _correction_dim(c.beta_slow, dim, base, orig)
    if c.rope_yarn_truncate:  # whole dims (the paper's); GPT-OSS keeps the fractions
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    keep_extrapolated = 1.0 - ramp
    inv_freq = interpolation * (1.0 - keep_extrapolated) + extrapolation * keep_extrapolated
    if c.mscale and c.mscale_all_dim:
        amplitude = yarn_mscale(c.rope_factor, c.mscale) / yarn_mscale(
            c.rope_factor, c.mscale_all_dim
        )
    else:
        amplitude = yarn_mscale(c.rope_factor)
    return inv_freq, amplitude


def softmax_scale(c: Config) -> float:
    """Attention logit scale: 1/sqrt(qk dim), times mscale(all_dim)^2 under YaRN (DeepSeek)."""
    scale = c.qk_head_dim**-0.5
    if c.rope_type == "yarn" and c.mscale_all_dim:
        scale *= yarn_mscale(c.rope_factor, c.mscale_all_dim) ** 2
    return scale


def cos_sin(c: Config, positions_BT: jax.Array, dim: int) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [B, T, A] (A = dim/2 rotation angles) in float32 for the positions."""
    inv_freq, amplitude = inverse_frequencies(c, dim)
    angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    return jnp.cos(angles) * amplitude, jnp.sin(angles) * amplitude


def rotary_dim(c: Config) -> int:
    """The head dims GQA's RoPE rotates: head_dim x partial_rotary_factor (checks.py: even)."""
    return int(c.head_dim * c.partial_rotary_factor)


def apply(x_BTHQ: jax.Array, cos_BTA: jax.Array, sin_BTA: jax.Array) -> jax.Array:
    """Rotate the first 2A dims of x [B, T, H, Q] (half-split pairs; A angles per position, Q/2
    for the whole head); the dims after them (partial RoPE) pass as they are."""
    half = cos_BTA.shape[-1]
    x32 = x_BTHQ.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half : 2 * half]
    cos, sin = cos_BTA[:, :, None, :], sin_BTA[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTHQ.dtype)
    if 2 * half == x_BTHQ.shape[-1]:
        return out
    return jnp.concatenate([out, x_BTHQ[..., 2 * half :]], axis=-1)
