"""AdamW's update with the optimizer state in pinned host memory
(`optimizer_memory_host_offload`), streamed one layer at a time.

Copying the whole state to device memory for the update (`jax.device_put` of the tree) costs
the device its full size: the TPU compiler prefetches such a copy as early as it may, so it is
alive through the backward pass's peak (DeepSeek-V3 671B on `tpu:v5p-256`, e4 f32 exp-fsdp:
119.95 GiB with the state on device, 120.49 GiB "offloaded"; 114.40 GiB streamed as below:
docs/design/fit.md#host-offloaded-state-on-tpuv5p-256). Here every
leaf with a leading `layers` axis is updated in a loop over that axis:
each iteration moves one layer's moments to the device, updates that layer's parameters and
moments, and moves the moments back into their host buffers (in place: the loop carries them).
The device holds one layer's moments at a time. The unstacked leaves (embedding, output head,
final norm) and the stacked vectors ([layers, D] norm scales, biases: a TPU cannot slice its
host memory along a tiled dim, and they are small) are moved whole.

The update is optax's AdamW as `optimizer.make` chains it (global-norm clip over the trainable
gradients, bias-corrected moments computed in float32 and stored in `mu_dtype` / `nu_dtype`,
decoupled weight decay where `ParamSpec.weight_decay`, the learning-rate schedule), then the
step's guard: nothing changes where `finite` is false. Muon's update (train/muon.py) and any
update with the parameters offloaded too are not streamed (`streams`): they take the state
whole (`train_step`'s `opt_to_device`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from expertax.config.schema import Config
from expertax.nn import param
from expertax.train import optimizer

# `layers` only: a pipelined stack's `stage_layers` axis is split over `pipeline`, and a loop
# slicing a split axis would gather the whole leaf to every device; such stacks move whole
STACK_AXES = ("layers",)


def streams(opt_type: str, parameters_offloaded: bool) -> bool:
    """Whether the step streams its offloaded optimizer state: AdamW's, with the parameters in
    device memory. Muon's update takes its state whole; with the parameters in host memory too
    the TPU compiler (libtpu 0.0.42.1) fails on the streamed program at DeepSeek-V3's size
    ("Expected instruction to have shape ... S(5)"), and the whole copy compiles."""
    return opt_type == "adamw" and not parameters_offloaded


def streamed_mask(spec_tree) -> Any:
    """Per parameter leaf: whether its optimizer state streams one layer at a time: a leading
    layer axis and at least two more dims (a TPU cannot slice its host memory along a tiled
    dim: the [layers, D] vectors are moved whole)."""
    return jax.tree.map(
        lambda s: s.axes[:1] in [(a,) for a in STACK_AXES] and len(s.shape) >= 3,
        spec_tree,
        is_leaf=param.is_spec,
    )


def _to_device(x):
    return jax.device_put(x, jax.memory.Space.Device)


def _to_host(x):
    return jax.device_put(x, jax.memory.Space.Host)


def _same(x):
    return x


def apply(
    c: Config, spec_tree, grads, opt_state, params, finite, host: bool = True
) -> tuple[Any, Any]:
    """(params, opt_state) after one AdamW step where `finite`, else unchanged, the optimizer
    state in pinned host memory in and out (module docstring). `host=False`: the same loop with
    no transfers (XLA:CPU, which has no pinned host memory, runs the update's numerics this
    way)."""

    def moves(x) -> tuple:
        """(to device, back) for a moment leaf: transfers where it is in host memory (a GPU
        compile without a GPU keeps it in device memory: planner/plan.py reports that)."""
        on_host = getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host
        return (_to_device, _to_host) if host and on_host else (_same, _same)

    adam, sched = optimizer.adamw_states(opt_state)
    specs = jax.tree.leaves(spec_tree, is_leaf=param.is_spec)
    b1, b2, eps, wd = c.adam_b1, c.adam_b2, c.adam_eps, c.adam_weight_decay
    mu_dtype, nu_dtype = jnp.dtype(c.mu_dtype), jnp.dtype(c.nu_dtype)
    count = optax.safe_increment(adam.count)
    t = count.astype(jnp.float32)
    inv_bias1, inv_bias2 = 1 / (1 - b1**t), 1 / (1 - b2**t)
    lr = optimizer.schedule(c)(sched.count)
    g_leaves = jax.tree.leaves(grads)
    trained = [i for i, s in enumerate(specs) if s.trainable]
    streamed = jax.tree.leaves(streamed_mask(spec_tree))
    scale = jnp.float32(1)
    if c.gradient_clipping_threshold > 0:
        norm = optax.tree.norm([g_leaves[i] for i in trained])
        clip = c.gradient_clipping_threshold
        scale = jnp.where(norm < clip, jnp.float32(1), clip / norm)

    def step(p, m, v, g, decay):
        """One leaf (or one layer of it): its new parameter and moments, on device."""
        g = g.astype(jnp.float32) * scale
        m32 = b1 * m.astype(jnp.float32) + (1 - b1) * g
        v32 = b2 * v.astype(jnp.float32) + (1 - b2) * (g * g)
        u = (m32 * inv_bias1) / (jnp.sqrt(v32 * inv_bias2) + eps)
        if decay:
            u = u + wd * p.astype(jnp.float32)
        keep = lambda new, old: jnp.where(finite, new, old)
        new_p = keep((p.astype(jnp.float32) - lr * u).astype(p.dtype), p)
        return new_p, keep(m32.astype(mu_dtype), m), keep(v32.astype(nu_dtype), v)

    p_leaves, p_def = jax.tree.flatten(params)
    is_masked = lambda x: isinstance(x, optax.MaskedNode)
    m_leaves, m_def = jax.tree.flatten(adam.mu, is_leaf=is_masked)
    v_leaves, v_def = jax.tree.flatten(adam.nu, is_leaf=is_masked)
    new_p, new_m, new_v = list(p_leaves), list(m_leaves), list(v_leaves)
    groups: dict[int, list[int]] = {}
    for i in trained:
        if streamed[i]:
            groups.setdefault(specs[i].shape[0], []).append(i)
        else:
            to_device, to_host = moves(m_leaves[i])
            p, m, v = step(
                p_leaves[i],
                to_device(m_leaves[i]),
                to_device(v_leaves[i]),
                g_leaves[i],
                specs[i].weight_decay,
            )
            new_p[i], new_m[i], new_v[i] = p, to_host(m), to_host(v)
    for n, idx in groups.items():

        def body(layer, carry, idx=idx):
            ps, ms, vs = carry
            at = lambda x: jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)
            put = lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, layer, 0)
            out_p, out_m, out_v = [], [], []
            for k, i in enumerate(idx):
                to_device, to_host = moves(m_leaves[i])
                p, m, v = step(
                    at(ps[k]),
                    to_device(at(ms[k])),
                    to_device(at(vs[k])),
                    at(g_leaves[i]),
                    specs[i].weight_decay,
                )
                out_p.append(put(ps[k], p))
                out_m.append(put(ms[k], to_host(m)))
                out_v.append(put(vs[k], to_host(v)))
            return out_p, out_m, out_v

        carry = ([p_leaves[i] for i in idx], [m_leaves[i] for i in idx], [v_leaves[i] for i in idx])
        ps, ms, vs = jax.lax.fori_loop(0, n, body, carry)
        for k, i in enumerate(idx):
            new_p[i], new_m[i], new_v[i] = ps[k], ms[k], vs[k]
    mu = jax.tree.unflatten(m_def, new_m)
    nu = jax.tree.unflatten(v_def, new_v)
    return jax.tree.unflatten(p_def, new_p), optimizer.stepped(opt_state, count, mu, nu, finite)
