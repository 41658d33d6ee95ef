"""AdamW (or Muon, `opt_type=muon`: train/muon.py) with linear warmup and cosine decay,
global-norm clipping; frozen leaves untouched.

Which leaves are trained and which are weight-decayed comes from the parameter declarations
(`ParamSpec.trainable`, `ParamSpec.weight_decay`), never from shapes.

`make` builds the optax transformation: it defines the optimizer state (its init, its pytree,
hence the checkpoints' layout). `apply` is the step's update on that state. With float32 moments
(the default) it computes what optax's update, `apply_updates` and the step's non-finite guard
compute, in three passes over each leaf: first moment, second moment, parameter. Chained optax
transformations cost 2.3-3 x that on XLA:CPU (`benchmarks/optimizer.py`, 2-core VM: 80.5 -> 26.3
ms for 49 M parameters, BENCHMARKS.md), because XLA makes one loop per output and does not fuse
an elementwise divide into several consumers: the clipped gradient and the bias-corrected
moments are separate passes, and the moments are copied so that the parameter pass can still
read their old values.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from expertax.config.schema import Config
from expertax.nn import param
from expertax.train import muon


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
    if c.opt_type == "muon":
        return muon.make(c, spec_tree, schedule(c), adamw)
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


def _is_state(x) -> bool:
    return isinstance(x, (optax.ScaleByAdamState, optax.ScaleByScheduleState))


def optax_update(tx, grads, opt_state, params, finite) -> tuple[Any, Any]:
    """What `apply` computes, as optax chains it: `tx.update`, `apply_updates`, then a select
    per leaf that keeps the given (params, opt_state) where not `finite`."""
    updates, new_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda n, o: jnp.where(finite, n, o)
    return jax.tree.map(keep, (new_params, new_state), (params, opt_state))


def apply(c: Config, tx, spec_tree, grads, opt_state, params, finite) -> tuple[Any, Any]:
    """(params, opt_state) after one AdamW step where `finite` (a bool scalar), else the given
    ones unchanged, in `tx`'s state layout (`tx = make(c, spec_tree)`).

    Float32 moments take the fused path (module docstring); other moment dtypes and Muon
    (train/muon.py) run optax's update, whose step uses the moments before they are rounded to
    their dtype.
    """
    fused = c.opt_type == "adamw" and jnp.dtype(c.mu_dtype) == jnp.float32
    if not fused or jnp.dtype(c.nu_dtype) != jnp.float32:
        return optax_update(tx, grads, opt_state, params, finite)
    adam, sched = adamw_states(opt_state)
    trainable = param.trainable_mask(spec_tree)
    decay = param.weight_decay_mask(spec_tree)
    b1, b2, eps, wd = c.adam_b1, c.adam_b2, c.adam_eps, c.adam_weight_decay
    count = optax.safe_increment(adam.count)
    t = count.astype(jnp.float32)
    inv_bias1, inv_bias2 = 1 / (1 - b1**t), 1 / (1 - b2**t)
    lr = schedule(c)(sched.count)
    # the clip scale as one scalar: a divide per element would be a pass of its own
    clip = c.gradient_clipping_threshold
    scale = jnp.float32(1)
    if clip > 0:
        masked = jax.tree.map(lambda g, tr: g if tr else jnp.zeros((), g.dtype), grads, trainable)
        norm = optax.tree.norm(masked)
        scale = jnp.where(norm < clip, jnp.float32(1), clip / norm)
    is_masked = lambda x: isinstance(x, optax.MaskedNode)

    def moments(m, v, g, tr):
        if not tr:
            return m, v
        g = g.astype(jnp.float32) * scale
        m_new = jnp.where(finite, b1 * m + (1 - b1) * g, m)
        v_new = jnp.where(finite, b2 * v + (1 - b2) * (g * g), v)
        return m_new, v_new

    pairs = jax.tree.map(moments, adam.mu, adam.nu, grads, trainable, is_leaf=is_masked)
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2
    mu = jax.tree.map(lambda x: x[0], pairs, is_leaf=is_pair)
    nu = jax.tree.map(lambda x: x[1], pairs, is_leaf=is_pair)
    # The parameter pass reads the new moments instead of recomputing them from the old: each
    # moment is then written in place, once, and never copied.
    mu, nu = jax.lax.optimization_barrier((mu, nu))

    def parameter(p, m, v, tr, dec):
        if not tr:
            return p
        u = (m * inv_bias1) / (jnp.sqrt(v * inv_bias2) + eps)
        if dec:
            u = u + wd * p
        return jnp.where(finite, p - lr * u, p).astype(p.dtype)

    new_params = jax.tree.map(parameter, params, mu, nu, trainable, decay, is_leaf=is_masked)
    return new_params, stepped(opt_state, count, mu, nu, finite)


def adamw_states(opt_state) -> tuple[optax.ScaleByAdamState, optax.ScaleByScheduleState]:
    """The AdamW and learning-rate schedule states of `make`'s transformation."""
    nodes = jax.tree.leaves(opt_state, is_leaf=_is_state)
    adams = [n for n in nodes if isinstance(n, optax.ScaleByAdamState)]
    scheds = [n for n in nodes if isinstance(n, optax.ScaleByScheduleState)]
    if len(adams) != 1 or len(scheds) != 1:
        structure = jax.tree.structure(opt_state)
        raise ValueError(f"expected the state of optimizer.make, got {structure}")
    return adams[0], scheds[0]


def stepped(opt_state, count, mu, nu, finite):
    """`opt_state` after an AdamW step that computed the new `count` and moments: both step
    counts advanced and the moments replaced where `finite`, else the counts kept."""
    adam, sched = adamw_states(opt_state)
    new_adam = adam._replace(count=jnp.where(finite, count, adam.count), mu=mu, nu=nu)
    new_sched = sched._replace(
        count=jnp.where(finite, optax.safe_increment(sched.count), sched.count)
    )

    def replace(node):
        if isinstance(node, optax.ScaleByAdamState):
            return new_adam
        return new_sched if isinstance(node, optax.ScaleByScheduleState) else node

    return jax.tree.map(replace, opt_state, is_leaf=_is_state)
