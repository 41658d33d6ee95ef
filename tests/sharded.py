"""One helper for tests that compare a sharded computation with its one-device run."""

from __future__ import annotations

import jax

from expertax.train.trainer import build_trainer


def on_mesh(c, params, batch, fn):
    """`fn(c, params, batch)` with params and batch placed in the shardings `c`'s trainer uses,
    inside its mesh and rules."""
    trainer = build_trainer(c)
    with trainer.context():
        placed = jax.device_put(params, trainer.state_shardings.params)
        rows = {k: jax.device_put(v, trainer.batch_sharding) for k, v in batch.items()}
        return fn(c, placed, rows), placed
