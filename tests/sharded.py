"""One helper for tests that compare a sharded computation with its one-device run."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from expertax.train.trainer import build_trainer


def on_mesh(c, params, batch, fn):
    """`fn(c, params, batch)` with params and batch placed in the shardings `c`'s trainer uses,
    inside its mesh and rules."""
    trainer = build_trainer(c)
    with trainer.context():
        placed = jax.device_put(params, trainer.state_shardings.params)
        rows = {k: jax.device_put(v, trainer.batch_sharding) for k, v in batch.items()}
        return fn(c, placed, rows), placed


def two_document_batch(vocab: int, b: int, t: int, cut: int) -> dict:
    """A batch of `b` random sequences of `t` tokens, each packing two documents (the second
    from position `cut`), every target weighted."""
    toks = jax.random.randint(jax.random.key(1), (b, t), 0, vocab)
    return {
        "inputs": toks,
        "targets": jnp.roll(toks, -1, axis=1),
        "weights": jnp.ones(toks.shape, jnp.float32),
        "positions": jnp.broadcast_to(jnp.arange(t), toks.shape),
        "segment_ids": (jnp.arange(t) >= cut).astype(jnp.int32)[None].repeat(b, 0),
    }


def assert_model_on_mesh_matches_one_device(c, one, params, batch) -> None:
    """The loss and gradients of `c`'s model on its mesh equal those of `one` (the same model on
    one device) to float32 reordering (rtol 1e-5)."""
    import numpy as np

    from expertax.train import step as step_lib

    def loss_and_grads(c, p, batch):
        return jax.jit(jax.value_and_grad(lambda p: step_lib.loss_fn(p, batch, c)[0]))(p)

    l1, g1 = loss_and_grads(one, params, batch)
    (l8, g8), _ = on_mesh(c, params, batch, loss_and_grads)
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
