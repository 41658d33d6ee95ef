"""The train step: loss, gradients, AdamW update, DeepSeek routing-bias update, metrics."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from expertax.config.schema import Config
from expertax.fp8 import stats as fp8_stats
from expertax.models import decoder, mtp
from expertax.nn import vocab_loss
from expertax.nn.attention import context
from expertax.nn.moe.router import MoEStats, updated_bias
from expertax.train import optimizer, qk_clip, streamed_update
from expertax.train.state import TrainState


class LossParts(NamedTuple):
    """`loss_fn`'s auxiliary outputs."""

    ce: jax.Array  # the main model's weighted cross-entropy
    lb: jax.Array  # the load-balance loss: mean over the MoE layers (MTP modules' included)
    stats: MoEStats | None  # the main MoE stack's, [L_moe, ...]
    mtp_losses: jax.Array | None = None  # [D] each MTP depth's weighted cross-entropy
    mtp_stats: MoEStats | None = None  # the MTP modules' MoE stats, [D, ...]
    mtp_weights: jax.Array | None = None  # [D] each depth's summed target weights
    # (hits, counted): the depth-1 head's top-1 agreement (`loss_fn(..., acceptance=True)`)
    mtp_accepted: tuple[jax.Array, jax.Array] | None = None


def _nll_sum(x_BTD, head_DV, targets_BT, w_BT, params, c: Config):
    """Weighted NLL sum of final-normed hidden states under the output head (tiled or not)."""
    if c.num_vocab_tiling > 1:
        return vocab_loss.tiled_nll_sum(x_BTD, head_DV, targets_BT, w_BT, c.num_vocab_tiling)
    return vocab_loss.nll_sum(decoder.logits(params, x_BTD, c), targets_BT, w_BT)


def loss_fn(params, batch: dict, c: Config, *, acceptance: bool = False, fp8_probes=None):
    """Weighted next-token cross-entropy plus the weighted load-balance loss, plus the
    multi-token-prediction loss lambda / D x sum_k CE_k with `mtp_num_layers` = D > 0
    (models/mtp.py). Returns (total, LossParts); `acceptance` (evaluation) also counts the
    depth-1 head's top-1 hits. `fp8_probes` (`fp8_probes(c)`): the layers' fp8 probes, whose
    gradient is the step's quantizer counts (fp8/stats.py).

    With `num_vocab_tiling` > 1 the cross-entropy is computed a sequence tile at a time from the
    hidden states (`nn.vocab_loss`), so the float32 [B, T, V] logits never exist at once.

    `routing_replay`: the MoE stack uses the batch's `routing` [B, T, L_moe, K] (-1: the
    router's own choice; router.route); the stats then carry the routers' own choices.
    `token_advantages`: each token's cross-entropy is multiplied by `advantages` [B, T], and the
    sum is divided by the mask's token count, sum(weights) (not by sum(weights x advantages),
    which may be 0 or negative).
    """
    batch = context.balance(batch, c, mtp.depth_targets)  # (context parallelism's reorder)
    kwargs = dict(positions_BT=batch.get("positions"), segment_ids_BT=batch.get("segment_ids"))
    w_BT = batch["weights"].astype(jnp.float32)
    x_BTD = decoder.embed_tokens(params, batch["inputs"], c)
    probes = fp8_probes or {}
    x_BTD, stats = decoder.hidden_states(
        params, x_BTD, c, probes=probes, imposed_LBTK=imposed_routing(batch, c), **kwargs
    )
    head_DV = decoder.output_head(params, c)
    token_w_BT = w_BT * batch["advantages"].astype(jnp.float32) if c.token_advantages else w_BT
    nll_sum = _nll_sum(x_BTD, head_DV, batch["targets"], token_w_BT, params, c)
    ce = nll_sum / jnp.maximum(jnp.sum(w_BT), 1.0)
    lb_layers = [stats.lb_loss] if stats is not None else []
    parts = LossParts(ce, jnp.float32(0), stats)
    total = ce
    if c.mtp_num_layers:
        depths, mtp_stats = mtp.forward(params, x_BTD, batch, c, probes.get("mtp"))
        weights_D = jnp.stack([jnp.sum(d.weights_BT) for d in depths])
        nll_D = jnp.stack(
            [_nll_sum(d.x_BTD, head_DV, d.targets_BT, d.weights_BT, params, c) for d in depths]
        )
        mtp_losses = nll_D / jnp.maximum(weights_D, 1.0)
        total = total + c.mtp_loss_scaling_factor * jnp.mean(mtp_losses)
        if mtp_stats is not None:
            lb_layers.append(mtp_stats.lb_loss)
        accepted = mtp.accepted(params, depths[0], c) if acceptance else None
        parts = parts._replace(
            mtp_losses=mtp_losses, mtp_stats=mtp_stats, mtp_weights=weights_D, mtp_accepted=accepted
        )
    lb = jnp.mean(jnp.concatenate(lb_layers)) if lb_layers else jnp.float32(0)
    total = total + c.load_balance_loss_weight * lb
    return total, parts._replace(lb=lb)


def imposed_routing(batch: dict, c: Config) -> jax.Array | None:
    """The batch's recorded routing as the MoE stack takes it, int32 [L_moe, B, T, K], under
    `routing_replay`; else None."""
    if not c.routing_replay:
        return None
    return jnp.moveaxis(batch["routing"].astype(jnp.int32), 2, 0)


def replay_flips(imposed_LBTK: jax.Array, chosen_LBTK: jax.Array) -> jax.Array:
    """Imposed (token, slot) assignments (>= 0) whose expert the router's own top-k did not
    choose for that token (the order of a token's K experts does not count), int32 [L_moe]."""
    found = jnp.any(imposed_LBTK[..., :, None] == chosen_LBTK[..., None, :], axis=-1)
    flipped = jnp.logical_and(imposed_LBTK >= 0, jnp.logical_not(found))
    return jnp.sum(flipped, axis=(1, 2, 3), dtype=jnp.int32)


def _with_router_bias(params: decoder.Decoder, bias_LE) -> decoder.Decoder:
    moe_layers = params.moe_layers
    if moe_layers is None or moe_layers.moe is None:
        raise ValueError("a routing-bias update needs a model with MoE layers")
    router = dataclasses.replace(moe_layers.moe.router, bias=bias_LE)
    moe = dataclasses.replace(moe_layers.moe, router=router)
    return dataclasses.replace(params, moe_layers=dataclasses.replace(moe_layers, moe=moe))


def _mtp_metrics_and_bias(params: decoder.Decoder, parts: LossParts, finite, metrics, c: Config):
    """The MTP metrics (`mtp_loss`: the mean over depths; `mtp_loss_<k>` per depth when D > 1)
    into `metrics`, and the MTP modules' routing-bias update from their own loads."""
    assert parts.mtp_losses is not None and params.mtp is not None
    metrics["mtp_loss"] = jnp.mean(parts.mtp_losses)
    if c.mtp_num_layers > 1:
        for k in range(c.mtp_num_layers):
            metrics[f"mtp_loss_{k + 1}"] = parts.mtp_losses[k]
    st = parts.mtp_stats
    if st is None:
        return params
    metrics["dropped_tokens"] = metrics["dropped_tokens"] + jnp.sum(st.dropped)
    block = params.mtp.block
    assert block.moe is not None
    bias = block.moe.router.bias
    if bias is None:
        return params
    new_bias = jnp.where(finite, updated_bias(bias, st.load_E, c.routed_bias_update_rate), bias)
    router = dataclasses.replace(block.moe.router, bias=new_bias)
    block = dataclasses.replace(block, moe=dataclasses.replace(block.moe, router=router))
    return dataclasses.replace(params, mtp=dataclasses.replace(params.mtp, block=block))


class NonFiniteError(RuntimeError):
    """A step's loss or gradient was NaN/Inf and skip_nonfinite_steps is false."""


def fp8_probes(c: Config) -> dict | None:
    """One fp8 probe per decoder layer and MTP module (float32 zeros, fp8/stats.py) by stack:
    "dense", "moe", "mtp"; None without `quantization`."""
    if not c.quantization:
        return None
    sizes = {"dense": c.num_dense_layers, "moe": c.num_moe_layers, "mtp": c.mtp_num_layers}
    return {k: fp8_stats.zeros(n) for k, n in sizes.items() if n}


def _debug_nan_loss_fn(params, batch: dict, c: Config, step, fp8_probes=None):
    """`loss_fn`, made NaN at step `debug_inject_nan_step` (tests of the non-finite handling)."""
    total, aux = loss_fn(params, batch, c, fp8_probes=fp8_probes)
    poison = jnp.where(step == c.debug_inject_nan_step, jnp.float32(jnp.nan), jnp.float32(1))
    return total * poison, aux._replace(ce=aux.ce * poison)


def train_step(
    state: TrainState, batch: dict, *, c: Config, tx, opt_to_device=None
) -> tuple[TrainState, dict]:
    """One update. A non-finite loss or gradient norm leaves params and optimizer state as they
    were (metric `nonfinite` = 1); the loop then stops or counts a skip (skip_nonfinite_steps).
    Guarding in every mode means no checkpoint ever holds a NaN state.

    `opt_to_device` (optimizer state in pinned host memory): given, AdamW's update streams the
    state through the device one layer at a time (train/streamed_update.py `streams`), else the
    state is copied to device memory whole; either starts only once the gradients exist (an
    optimization barrier ties the two)."""
    probes = qk_clip.merge(fp8_probes(c), qk_clip.probes(c))
    if c.debug_inject_nan_step >= 0:
        fn = functools.partial(_debug_nan_loss_fn, batch=batch, c=c, step=state.step)
    else:
        fn = functools.partial(loss_fn, batch=batch, c=c)
    grad_fn = jax.value_and_grad(
        lambda p, probes: fn(p, fp8_probes=probes), argnums=(0, 1), has_aux=True
    )
    (_, parts), (grads, probe_grads) = grad_fn(state.params, probes)
    counts, qk_maxima = qk_clip.split(probe_grads, c.use_qk_clip)
    ce, lb, stats = parts.ce, parts.lb, parts.stats
    grad_dtype = jnp.dtype(c.grad_dtype)
    if grad_dtype != jnp.dtype(c.weight_dtype):
        grads = jax.tree.map(lambda g: g.astype(grad_dtype), grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(ce) & jnp.isfinite(lb) & jnp.isfinite(grad_norm)
    if parts.mtp_losses is not None:
        finite = finite & jnp.all(jnp.isfinite(parts.mtp_losses))
    opt_state = state.opt_state
    if opt_to_device is not None:
        grads, opt_state = jax.lax.optimization_barrier((grads, opt_state))
    if opt_to_device is not None and streamed_update.streams(
        c.opt_type, c.parameter_memory_host_offload
    ):
        # one layer's moments on the device at a time (train/streamed_update.py)
        params, opt_state = streamed_update.apply(
            c, decoder.spec(c), grads, opt_state, state.params, finite
        )
    else:
        if opt_to_device is not None:  # Muon, or parameters offloaded too: the state whole
            opt_state = opt_to_device(opt_state)
        params, opt_state = optimizer.apply(
            c, tx, decoder.spec(c), grads, opt_state, state.params, finite
        )
    metrics = {
        "loss": ce,
        "lb_loss": lb,
        "grad_norm": grad_norm,
        "nonfinite": 1 - finite.astype(jnp.float32),
        "learning_rate": optimizer.schedule(c)(state.step),
        "dropped_tokens": jnp.int32(0),
        "max_expert_load_ratio": jnp.float32(1),
    }
    if counts is not None:  # the quantizers' counts (fp8/stats.py)
        metrics.update(fp8_stats.metrics(counts))
    if qk_maxima is not None:  # QK-clip: the heads over the threshold scaled (train/qk_clip.py)
        params, clip_metrics = qk_clip.clip(params, qk_maxima, finite, c)
        metrics.update(clip_metrics)
    if stats is not None:
        load = stats.load_E
        metrics["expert_load"] = load  # [L_moe, E] assignments per expert (metrics.jsonl, TB)
        metrics["dropped_tokens"] = jnp.sum(stats.dropped)
        metrics["max_expert_load_ratio"] = jnp.max(load / jnp.mean(load, -1, keepdims=True))
        if stats.chosen_BTK is not None:  # routing_replay: the sampler's against our routers'
            imposed_LBTK = imposed_routing(batch, c)
            assert imposed_LBTK is not None
            metrics["routing_replay_flips"] = jnp.sum(replay_flips(imposed_LBTK, stats.chosen_BTK))
        if stats.stash_overflow is not None:  # moe_paged_stash (models/stashed_stack.py)
            metrics["stash_overflow_layers"] = jnp.sum(stats.stash_overflow)
            metrics["stash_capacity_factor_needed"] = jnp.max(stats.stash_factor)
        if params.moe_layers.moe.router.bias is not None:
            bias = params.moe_layers.moe.router.bias
            new_bias = updated_bias(bias, load, c.routed_bias_update_rate)
            params = _with_router_bias(params, jnp.where(finite, new_bias, bias))
    if parts.mtp_losses is not None:
        params = _mtp_metrics_and_bias(params, parts, finite, metrics, c)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=state.rng)
    return new_state, metrics
