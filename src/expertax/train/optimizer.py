"""AdamW with linear warmup and cosine decay, global-norm clipping; frozen leaves untouched.

Which leaves are trained and which are weight-decayed comes from the parameter declarations
(`ParamSpec.trainable`, `ParamSpec.weight_decay`), never from shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from expertax.config.schema import Config
from expertax.nn import param


def schedule(c: Config) -> optax.Schedule:
    """Linear warmup then cosine decay over `steps`; at least one warmup step and one decay
    step, so short runs (`steps=1`) get a valid schedule too."""
    warmup = max(int(c.steps * c.warmup_steps_fraction), 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=c.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(c.steps, warmup + 1),
        end_value=c.learning_rate * c.cosine_learning_rate_final_fraction,
    )


def make(c: Config, spec_tree) -> optax.GradientTransformation:
    """The optimizer for the parameters declared by `spec_tree` (`ParamSpec` leaves).

    Leaves with `trainable=False` are never moved; weight decay applies where `weight_decay`.
    """
    decay_mask = param.weight_decay_mask(spec_tree)
    trainable_mask = param.trainable_mask(spec_tree)
    adamw = optax.adamw(
        schedule(c),
        b1=c.adam_b1,
        b2=c.adam_b2,
        eps=c.adam_eps,
        weight_decay=c.adam_weight_decay,
        mu_dtype=jnp.dtype(c.mu_dtype),
        mask=decay_mask,
    )
    if jnp.dtype(c.nu_dtype) != jnp.float32:
        adamw = _second_moment_stored_as(adamw, jnp.dtype(c.nu_dtype))
    chain = [adamw]
    if c.gradient_clipping_threshold > 0:
        chain.insert(0, optax.clip_by_global_norm(c.gradient_clipping_threshold))
    labels = jax.tree.map(lambda t: "train" if t else "frozen", trainable_mask)
    return optax.multi_transform(
        {"train": optax.chain(*chain), "frozen": optax.set_to_zero()}, labels
    )


def _cast_nu(state, dtype):
    """`state` with the AdamW second moment (every `ScaleByAdamState.nu`) cast to `dtype`."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    return jax.tree.map(
        lambda s: s._replace(nu=jax.tree.map(lambda v: v.astype(dtype), s.nu)) if is_adam(s) else s,
        state,
        is_leaf=is_adam,
    )


def _second_moment_stored_as(
    tx: optax.GradientTransformation, dtype
) -> optax.GradientTransformation:
    """`tx` whose AdamW second moment is stored in `dtype` (e.g. bfloat16) between steps.

    The update itself runs as optax computes it: the stored moment is promoted by the float32
    gradient's square, and the new moment is rounded to `dtype` once, when it is stored.
    """

    def init(params):
        return _cast_nu(tx.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = tx.update(updates, state, params)
        return updates, _cast_nu(state, dtype)

    return optax.GradientTransformation(init, update)
