"""The train step: loss, gradients, AdamW update, DeepSeek routing-bias update, metrics."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from expertax.config.schema import Config
from expertax.models import decoder
from expertax.nn.moe.router import updated_bias
from expertax.train import optimizer
from expertax.train.state import TrainState


def loss_fn(params, batch: dict, c: Config):
    """Weighted next-token cross-entropy plus the weighted load-balance loss."""
    logits, stats = decoder.forward(
        params,
        batch["inputs"],
        c,
        positions_BT=batch.get("positions"),
        segment_ids_BT=batch.get("segment_ids"),
    )
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    w = batch["weights"].astype(jnp.float32)
    ce = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)
    lb = jnp.mean(stats.lb_loss) if stats is not None else jnp.float32(0)
    total = ce + c.load_balance_loss_weight * lb
    return total, (ce, lb, stats)


def _with_router_bias(params: decoder.Decoder, bias_LE) -> decoder.Decoder:
    moe_layers = params.moe_layers
    router = dataclasses.replace(moe_layers.moe.router, bias=bias_LE)
    moe = dataclasses.replace(moe_layers.moe, router=router)
    return dataclasses.replace(params, moe_layers=dataclasses.replace(moe_layers, moe=moe))


def train_step(state: TrainState, batch: dict, *, c: Config, tx) -> tuple[TrainState, dict]:
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, (ce, lb, stats)), grads = grad_fn(state.params, batch, c)
    grad_dtype = jnp.dtype(c.grad_dtype)
    if grad_dtype != jnp.dtype(c.weight_dtype):
        grads = jax.tree.map(lambda g: g.astype(grad_dtype), grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": ce,
        "lb_loss": lb,
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": optimizer.schedule(c)(state.step),
        "dropped_tokens": jnp.float32(0),
        "max_expert_load_ratio": jnp.float32(1),
    }
    if stats is not None:
        load = stats.load_E
        metrics["dropped_tokens"] = jnp.sum(stats.dropped)
        metrics["max_expert_load_ratio"] = jnp.max(load / jnp.mean(load, -1, keepdims=True))
        if params.moe_layers.moe.router.bias is not None:
            bias = params.moe_layers.moe.router.bias
            params = _with_router_bias(params, updated_bias(bias, load, c.routed_bias_update_rate))
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=state.rng)
    return new_state, metrics
