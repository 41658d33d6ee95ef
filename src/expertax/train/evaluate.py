"""Held-out evaluation: the loss of the current parameters on the same eval_steps batches.

The forward is `step.loss_fn` (so vocab tiling, MoE routing and the routing bias are the train
step's), jitted and compiled once with the train state's parameter shardings and the batch
sharding of the mesh. The loss is token-weighted over all eval batches:

    eval_loss = sum_b ce_b * w_b / sum_b w_b      (w_b: the batch's summed target weights)

Every evaluation rewinds the eval iterator to its start, so evaluations at different steps see the
same tokens and compare; the training iterator is never touched, so resume stays bitwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.train import metrics as metrics_lib
from expertax.train.step import loss_fn
from expertax.train.trainer import Trainer


def eval_forward(params, batch: dict, *, c: Config):
    """(cross-entropy of the batch, its summed weights) as float32 scalars; with MTP also the
    depths' cross-entropies and their weights ([D] each), and the depth-1 head's top-1 hits and
    the positions they count over (models/mtp.py `accepted`)."""
    _, parts = loss_fn(params, batch, c, acceptance=bool(c.mtp_num_layers))
    out = (parts.ce, jnp.sum(batch["weights"].astype(jnp.float32)))
    if parts.mtp_accepted is None:
        return out
    return (*out, parts.mtp_losses, parts.mtp_weights, *parts.mtp_accepted)


class Evaluator:
    """Compiled once; `run(params)` evaluates on eval_steps batches of `data` from its start."""

    def __init__(self, c: Config, trainer: Trainer, data):
        self.c, self.trainer, self.data = c, trainer, data
        self.start = data.get_state()
        on_device = trainer.device_state_shardings

        def forward(params, batch):
            if on_device is not None:  # host-offloaded parameters: computed in device memory
                params = jax.device_put(params, on_device.params)
            return eval_forward(params, batch, c=c)

        jitted = jax.jit(
            forward,
            in_shardings=(trainer.state_shardings.params, trainer.batch_sharding),
            out_shardings=None,
        )
        with trainer.context():
            abstract = trainer.abstract_state().params
            self.forward = jitted.lower(abstract, trainer.abstract_batch()).compile()

    def due(self, done: int) -> bool:
        """Whether to evaluate after `done` steps: every eval_interval steps and after the last."""
        every = self.c.eval_interval
        return every > 0 and (done % every == 0 or done == self.c.steps)

    def run(self, params) -> dict:
        """{"eval_loss", "eval_perplexity", "eval_tokens"} of `params` (blocks until done)."""
        self.data.set_state(self.start)
        parts = []
        with self.trainer.context():
            for _ in range(self.c.eval_steps):
                parts.append(self.forward(params, self.trainer.put_batch(next(self.data))))
        host = jax.device_get(parts)
        weights = sum(float(p[1]) for p in host)
        loss = sum(float(p[0]) * float(p[1]) for p in host) / max(weights, 1.0)
        out = {
            "eval_loss": loss,
            "eval_perplexity": metrics_lib.perplexity(loss),
            "eval_tokens": int(weights),
        }
        if self.c.mtp_num_layers:
            out.update(mtp_eval(host, self.c.mtp_num_layers))
        return out


def mtp_eval(host: list, depths: int) -> dict:
    """`eval_mtp_loss` (token-weighted over batches, mean over depths; per depth as
    `eval_mtp_loss_<k>` when D > 1) and `eval_mtp_acceptance` (the depth-1 head's top-1
    agreement with its targets) from the evaluated batches' `eval_forward` outputs."""
    out = {}
    losses = []
    for k in range(depths):
        w = sum(float(p[3][k]) for p in host)
        losses.append(sum(float(p[2][k]) * float(p[3][k]) for p in host) / max(w, 1.0))
        if depths > 1:
            out[f"eval_mtp_loss_{k + 1}"] = losses[-1]
    out["eval_mtp_loss"] = sum(losses) / depths
    out["eval_mtp_acceptance"] = sum(float(p[4]) for p in host) / max(
        sum(float(p[5]) for p in host), 1.0
    )
    return out
