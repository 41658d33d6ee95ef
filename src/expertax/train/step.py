"""The train step: loss, gradients, AdamW update, DeepSeek routing-bias update, metrics."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from expertax.config.schema import Config
from expertax.models import decoder
from expertax.nn import vocab_loss
from expertax.nn.moe.router import updated_bias
from expertax.train import optimizer
from expertax.train.state import TrainState


def loss_fn(params, batch: dict, c: Config):
    """Weighted next-token cross-entropy plus the weighted load-balance loss.

    With `num_vocab_tiling` > 1 the cross-entropy is computed a sequence tile at a time from the
    hidden states (`nn.vocab_loss`), so the float32 [B, T, V] logits never exist at once.
    """
    kwargs = dict(positions_BT=batch.get("positions"), segment_ids_BT=batch.get("segment_ids"))
    w_BT = batch["weights"].astype(jnp.float32)
    if c.num_vocab_tiling > 1:
        x_BTD = decoder.embed_tokens(params, batch["inputs"], c)
        x_BTD, stats = decoder.hidden_states(params, x_BTD, c, **kwargs)
        head_DV = decoder.output_head(params, c)
        nll_sum = vocab_loss.tiled_nll_sum(
            x_BTD, head_DV, batch["targets"], w_BT, c.num_vocab_tiling
        )
    else:
        logits_BTV, stats = decoder.forward(params, batch["inputs"], c, **kwargs)
        nll_sum = vocab_loss.nll_sum(logits_BTV, batch["targets"], w_BT)
    ce = nll_sum / jnp.maximum(jnp.sum(w_BT), 1.0)
    lb = jnp.mean(stats.lb_loss) if stats is not None else jnp.float32(0)
    total = ce + c.load_balance_loss_weight * lb
    return total, (ce, lb, stats)


def _with_router_bias(params: decoder.Decoder, bias_LE) -> decoder.Decoder:
    moe_layers = params.moe_layers
    if moe_layers is None or moe_layers.moe is None:
        raise ValueError("a routing-bias update needs a model with MoE layers")
    router = dataclasses.replace(moe_layers.moe.router, bias=bias_LE)
    moe = dataclasses.replace(moe_layers.moe, router=router)
    return dataclasses.replace(params, moe_layers=dataclasses.replace(moe_layers, moe=moe))


class NonFiniteError(RuntimeError):
    """A step's loss or gradient was NaN/Inf and skip_nonfinite_steps is false."""


def _debug_nan_loss_fn(params, batch: dict, c: Config, step):
    """`loss_fn`, made NaN at step `debug_inject_nan_step` (tests of the non-finite handling)."""
    total, aux = loss_fn(params, batch, c)
    poison = jnp.where(step == c.debug_inject_nan_step, jnp.float32(jnp.nan), jnp.float32(1))
    ce, lb, stats = aux
    return total * poison, (ce * poison, lb, stats)


def train_step(
    state: TrainState, batch: dict, *, c: Config, tx, opt_to_device=None
) -> tuple[TrainState, dict]:
    """One update. A non-finite loss or gradient norm leaves params and optimizer state as they
    were (metric `nonfinite` = 1); the loop then stops or counts a skip (skip_nonfinite_steps).
    Guarding in every mode means no checkpoint ever holds a NaN state.

    `opt_to_device` (optimizer state in pinned host memory): the copy to device memory, made
    only once the gradients exist (an optimization barrier ties the two), so that the state is
    not on the device while the backward pass holds its activations."""
    if c.debug_inject_nan_step >= 0:
        grad_fn = jax.value_and_grad(_debug_nan_loss_fn, has_aux=True)
        (_, (ce, lb, stats)), grads = grad_fn(state.params, batch, c, state.step)
    else:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, (ce, lb, stats)), grads = grad_fn(state.params, batch, c)
    grad_dtype = jnp.dtype(c.grad_dtype)
    if grad_dtype != jnp.dtype(c.weight_dtype):
        grads = jax.tree.map(lambda g: g.astype(grad_dtype), grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(ce) & jnp.isfinite(lb) & jnp.isfinite(grad_norm)
    opt_state = state.opt_state
    if opt_to_device is not None:
        grads, opt_state = jax.lax.optimization_barrier((grads, opt_state))
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
    if stats is not None:
        load = stats.load_E
        metrics["expert_load"] = load  # [L_moe, E] assignments per expert (metrics.jsonl, TB)
        metrics["dropped_tokens"] = jnp.sum(stats.dropped)
        metrics["max_expert_load_ratio"] = jnp.max(load / jnp.mean(load, -1, keepdims=True))
        if stats.stash_overflow is not None:  # moe_paged_stash (models/stashed_stack.py)
            metrics["stash_overflow_layers"] = jnp.sum(stats.stash_overflow)
            metrics["stash_capacity_factor_needed"] = jnp.max(stats.stash_factor)
        if params.moe_layers.moe.router.bias is not None:
            bias = params.moe_layers.moe.router.bias
            new_bias = updated_bias(bias, load, c.routed_bias_update_rate)
            params = _with_router_bias(params, jnp.where(finite, new_bias, bias))
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=state.rng)
    return new_state, metrics
