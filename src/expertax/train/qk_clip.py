"""Kimi-K2's QK-clip (`use_qk_clip`, `qk_clip_threshold`; with `opt_type=muon`: MuonClip).

After each step's update, every MLA head h of every layer whose largest attention logit of the
step, S_h (nn/attention/qk_clip.py), passed the threshold tau has its query and key projections
scaled by gamma_h = tau / S_h, split as Kimi-K2 splits it: the head's no-RoPE query and key
parts by sqrt(gamma_h) each (their product by gamma_h), its RoPE query part by gamma_h; the RoPE
key, shared by every head, and the values are left alone. So the same batch would give that
head a largest logit of tau. In the parameters: the last-axis slices `[..., h, :nope]` and
`[..., h, nope:]` of `wq_b` (or `wq` without a query low rank) and `[..., h, :nope]` of
`wkv_b`. Heads at or below tau are untouched; a non-finite step (not applied) clips nothing.

The probes: float32 zeros [L, H] per stack ("dense", "moe", "mtp"), differentiated by the train
step beside the fp8 probes (`merge`, `split`); their gradient is S [L, H].
Metrics: `qk_max_logit` (the largest S of the step), `qk_clipped_heads` (how many heads were
scaled), and per stack `qk_max_logit_<stack>` [L] (metrics.jsonl: logged per layer).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from expertax.config.schema import Config

STACKS = {"dense": "dense_layers", "moe": "moe_layers", "mtp": "mtp"}


def probes(c: Config) -> dict | None:
    """Zeros [L, H] per stack with layers; None without `use_qk_clip`."""
    if not c.use_qk_clip:
        return None
    sizes = {"dense": c.num_dense_layers, "moe": c.num_moe_layers, "mtp": c.mtp_num_layers}
    h = c.base_num_query_heads
    return {k: jnp.zeros((n, h), jnp.float32) for k, n in sizes.items() if n}


def merge(fp8: dict | None, qk: dict | None) -> dict | None:
    """The layers' probes: the fp8 probes alone (as fp8/stats.py has them) without QK-clip,
    else per stack {"qk": ..., "fp8": ...} (models/decoder.py `block_apply` takes either)."""
    if qk is None:
        return fp8
    return {s: {"qk": q, **({"fp8": fp8[s]} if fp8 else {})} for s, q in qk.items()}


def split(grads: dict | None, qk_on: bool) -> tuple[dict | None, dict | None]:
    """(the fp8 probes' gradient, the QK-clip maxima) of the merged probes' gradient."""
    if grads is None or not qk_on:
        return grads, None
    fp8 = {s: g["fp8"] for s, g in grads.items() if "fp8" in g} or None
    return fp8, {s: g["qk"] for s, g in grads.items()}


def _scaled(w: jax.Array, gamma_LH: jax.Array, nope: int, rope_too: bool) -> jax.Array:
    """`w` [L, ..., H, Z] with `[..., :nope]` times sqrt(gamma) and, with `rope_too`,
    `[..., nope:]` times gamma (the rest untouched), per layer and head."""
    g = gamma_LH.reshape(gamma_LH.shape[0], *(1,) * (w.ndim - 3), gamma_LH.shape[1], 1)
    z = jnp.arange(w.shape[-1])
    factor = jnp.where(z < nope, jnp.sqrt(g), g if rope_too else 1.0)
    return (w.astype(jnp.float32) * factor).astype(w.dtype)


def _clip_attn(attn, gamma_LH: jax.Array, c: Config):
    nope = c.qk_nope_head_dim
    update = {"wkv_b": _scaled(attn.wkv_b, gamma_LH, nope, rope_too=False)}
    query = "wq" if attn.wq is not None else "wq_b"
    update[query] = _scaled(getattr(attn, query), gamma_LH, nope, rope_too=True)
    return dataclasses.replace(attn, **update)


def clip(params, maxima: dict, finite: jax.Array, c: Config) -> tuple:
    """(params with every head over `qk_clip_threshold` scaled, the metrics); nothing scaled
    where not `finite`."""
    tau = c.qk_clip_threshold
    metrics: dict = {}
    top, clipped = jnp.float32(-jnp.inf), jnp.int32(0)
    for stack, s_LH in maxima.items():
        over = finite & (s_LH > tau)
        gamma_LH = jnp.where(over, tau / jnp.where(over, s_LH, 1.0), 1.0)
        holder = getattr(params, STACKS[stack])
        if stack == "mtp":
            block = dataclasses.replace(
                holder.block, attn=_clip_attn(holder.block.attn, gamma_LH, c)
            )
            holder = dataclasses.replace(holder, block=block)
        else:
            holder = dataclasses.replace(holder, attn=_clip_attn(holder.attn, gamma_LH, c))
        params = dataclasses.replace(params, **{STACKS[stack]: holder})
        metrics[f"qk_max_logit_{stack}"] = jnp.max(s_LH, axis=1)
        top = jnp.maximum(top, jnp.max(s_LH))
        clipped = clipped + jnp.sum(over).astype(jnp.int32)
    metrics.update(qk_max_logit=top, qk_clipped_heads=clipped)
    return params, metrics
