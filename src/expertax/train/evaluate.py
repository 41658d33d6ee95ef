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
    """(cross-entropy of the batch, its summed weights): float32 scalars."""
    _, (ce, _, _) = loss_fn(params, batch, c)
    return ce, jnp.sum(batch["weights"].astype(jnp.float32))


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
        weights = sum(float(w) for _, w in host)
        loss = sum(float(ce) * float(w) for ce, w in host) / max(weights, 1.0)
        return {
            "eval_loss": loss,
            "eval_perplexity": metrics_lib.perplexity(loss),
            "eval_tokens": int(weights),
        }
