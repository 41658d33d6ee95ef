"""Muon (momentum orthogonalised by Newton-Schulz) for the matrices, AdamW for the rest.

`opt_type=muon`. Which leaves Muon takes comes from the parameter declarations: a projection
(`ParamSpec.fan_in > 0`) that is trained and is not the embedding or the output head (a `vocab`
axis); the MoE routers too unless `muon_include_routers=false`. Everything else (embeddings,
output head, norms, biases, sinks, 1-D parameters) is AdamW's, with the `adam_*` keys. MTP's
modules are layers like the others.

Each Muon leaf is read as a batch of matrices (`View`): its leading stack and expert axes
(`layers`, `stage_layers`, `exp`) index independent matrices; of the rest, the leading axes
whose sizes multiply to `fan_in` are the matrix's rows (its input) and the others its columns.
An expert stack [L, E, D, F] is thus L x E matrices D x F, orthogonalised as one batched
program, never E programs.

The update per matrix is optax's `contrib.muon` (the reference in the tests): first moment
`mu = beta mu + (1 - beta) g`, its Nesterov form with bias correction, the quintic
Newton-Schulz iteration (coefficients 3.4445, -4.7750, 2.0315; the matrix scaled by its
Frobenius norm first, transposed when it has more rows than columns), then scaled by
`muon_consistent_rms x sqrt(max(fan_in, fan_out))` (Moonlight's rule: the update's RMS is
AdamW's, so AdamW's learning rate and weight decay carry over), plus the decoupled weight
decay, times the learning rate of the shared schedule.

Sharding: Newton-Schulz wants each matrix whole. While it runs, a leaf's stack and expert
dims carry every mesh axis that divides them and its matrices are whole
(train/muon_layout.py: all-to-alls, gathers and slices in one shard_map), so that the devices
share the matrices instead of each orthogonalising all of them or a slice of each.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from expertax.config.schema import Config
from expertax.nn import param
from expertax.train import muon_layout

BATCH_AXES = frozenset({"layers", "stage_layers", "exp"})
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_SCOPE = "newton_schulz"


@dataclasses.dataclass(frozen=True)
class View:
    """A Muon leaf as matrices: `batch` leading axes index them, the next `rows` axes are a
    matrix's rows (its input, fan_in), the rest its columns (fan_out); `decay`: whether it is
    weight-decayed (`ParamSpec.weight_decay`)."""

    batch: int
    rows: int
    decay: bool = True
    axes: tuple[str | None, ...] = ()

    def sizes(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """(matrices, rows, columns) of a leaf of `shape`."""
        b, r = self.batch, self.batch + self.rows
        return math.prod(shape[:b]), math.prod(shape[b:r]), math.prod(shape[r:])


def view(s: param.ParamSpec, path: str = "") -> View:
    """The matrices of a projection `s` (`fan_in > 0`); `path` names it in the error."""
    batch = 0
    while batch < len(s.axes) and s.axes[batch] in BATCH_AXES:
        batch += 1
    own = s.shape[batch:]
    for rows in range(1, len(own)):
        if math.prod(own[:rows]) == s.fan_in:
            return View(batch, rows, s.weight_decay, s.axes)
    raise ValueError(
        f"{path or 'a projection'} {s.shape} {s.axes}: no leading axes after "
        f"{sorted(BATCH_AXES)} multiply to its fan_in {s.fan_in}"
    )


def _names(path) -> list[str]:
    return [str(getattr(k, "name", getattr(k, "key", k))) for k in path]


def labels(c: Config, spec_tree) -> Any:
    """ "muon", "adam" or "frozen" per leaf of `spec_tree` (module docstring)."""

    def label(path, s: param.ParamSpec) -> str:
        if not s.trainable:
            return "frozen"
        if s.fan_in <= 0 or "vocab" in s.axes:
            return "adam"
        if "router" in _names(path) and not c.muon_include_routers:
            return "adam"
        return "muon"

    return jax.tree_util.tree_map_with_path(label, spec_tree, is_leaf=param.is_spec)


def views(c: Config, spec_tree) -> Any:
    """`View` per Muon leaf of `spec_tree`, None for the others."""
    marks = labels(c, spec_tree)
    return jax.tree_util.tree_map_with_path(
        lambda path, s, m: view(s, jax.tree_util.keystr(path)) if m == "muon" else None,
        spec_tree,
        marks,
        is_leaf=param.is_spec,
    )


def newton_schulz_flops(c: Config, spec_tree) -> float:
    """The Newton-Schulz FLOPs of one step over every Muon matrix of `spec_tree` (2 per
    multiply-add; each of `muon_ns_steps` iterations on an m x n matrix, m <= n, costs
    4 m^2 n + 2 m^3). The zero matrices `muon_layout` pads with are not counted."""
    total = 0.0
    marks = jax.tree.leaves(labels(c, spec_tree))
    for s, mark in zip(jax.tree.leaves(spec_tree, is_leaf=param.is_spec), marks, strict=True):
        if mark != "muon":
            continue
        b, rows, cols = view(s).sizes(s.shape)
        m, n = min(rows, cols), max(rows, cols)
        total += b * c.muon_ns_steps * (4.0 * m * m * n + 2.0 * m**3)
    return total


def newton_schulz(x: jax.Array, steps: int, eps: float = 1e-8) -> jax.Array:
    """The quintic Newton-Schulz iteration on matrices [..., M, N], in x's dtype: an
    approximate U V^T of each matrix's SVD (singular values near 1, not exactly)."""
    wide = x.shape[-2] <= x.shape[-1]
    x = x if wide else jnp.swapaxes(x, -1, -2)
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
    x = x / (norm + jnp.asarray(eps, x.dtype))
    a0, a1, a2 = (jnp.asarray(k, x.dtype) for k in NS_COEFFS)
    for _ in range(steps):
        gram = jnp.einsum("...mn,...kn->...mk", x, x)
        poly = a1 * gram + a2 * jnp.einsum("...mk,...kl->...ml", gram, gram)
        x = a0 * x + jnp.einsum("...mk,...kn->...mn", poly, x)
    return x if wide else jnp.swapaxes(x, -1, -2)


def orthogonalize(
    x: jax.Array, v: View, steps: int, dtype, axes: tuple[str | None, ...] = ()
) -> jax.Array:
    """Newton-Schulz of every matrix of leaf `x` (shape kept, float32 out), each matrix whole
    on one device and the devices sharing the matrices (train/muon_layout.py; `axes`: the
    leaf's logical axes, for its storage layout)."""
    layout = muon_layout.plan(x.shape, axes or (None,) * x.ndim, v.batch)

    def whole(y: jax.Array) -> jax.Array:  # [B, *matrix dims]
        _, m, n = v.sizes((1,) * v.batch + y.shape[1:])
        with jax.named_scope(NS_SCOPE):  # the compiled program's op names (planner/flops.py)
            z = newton_schulz(y.astype(dtype).reshape(y.shape[0], m, n), steps)
        return z.astype(jnp.float32).reshape(y.shape)

    return muon_layout.apply(whole, x, v.batch, layout)


def rms_scale(c: Config, v: View, shape: tuple[int, ...]) -> float:
    """The factor of an orthogonalised update (`muon_consistent_rms`)."""
    _, fan_in, fan_out = v.sizes(shape)
    if c.muon_consistent_rms > 0:
        return c.muon_consistent_rms * math.sqrt(max(fan_in, fan_out))
    return math.sqrt(max(1.0, fan_out / fan_in))


class MuonState(NamedTuple):
    """Muon's state: the step count (its bias correction) and the first moment."""

    steps: jax.Array
    mu: Any


def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def scale_by_muon(c: Config, view_tree) -> optax.GradientTransformation:
    """The orthogonalised, RMS-scaled momentum of the Muon leaves (`view_tree`: a `View` per
    leaf; leaves masked out by the partition stay masked)."""
    beta, mu_dtype = c.muon_beta, jnp.dtype(c.mu_dtype)

    def init(params):
        mu = jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype), params)
        return MuonState(steps=jnp.zeros([], jnp.int32), mu=mu)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("Muon's weight decay needs the parameters")
        steps = optax.safe_increment(state.steps)
        t = steps.astype(jnp.float32)
        mu = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g, state.mu, updates)
        # Nesterov: the next step's bias-corrected moment, with this gradient's share
        bc_mu, bc_g = 1 - beta ** (t + 1), 1 - beta**t

        def step(m, g, p, v):
            if _is_masked(m):
                return m
            nesterov = beta * (m / bc_mu) + (1 - beta) * (g / bc_g)
            o = orthogonalize(nesterov, v, c.muon_ns_steps, jnp.dtype(c.muon_ns_dtype), v.axes)
            u = rms_scale(c, v, m.shape) * o
            return u + c.muon_weight_decay * p.astype(jnp.float32) if v.decay else u

        new = jax.tree.map(step, mu, updates, params, view_tree, is_leaf=_is_masked)
        mu = jax.tree.map(lambda m: m.astype(mu_dtype), mu)
        return new, MuonState(steps=steps, mu=mu)

    return optax.GradientTransformation(init, update)


def make(
    c: Config, spec_tree, schedule: optax.Schedule, adamw: optax.GradientTransformation
) -> optax.GradientTransformation:
    """Frozen leaves' gradients zeroed, the global norm clipped over the trained ones, then
    Muon for the matrices and `adamw` for the rest (module docstring)."""
    marks = labels(c, spec_tree)
    chain: list[optax.GradientTransformation] = [
        optax.multi_transform(
            {"train": optax.identity(), "frozen": optax.set_to_zero()},
            jax.tree.map(lambda m: "frozen" if m == "frozen" else "train", marks),
        )
    ]
    if c.gradient_clipping_threshold > 0:
        chain.append(optax.clip_by_global_norm(c.gradient_clipping_threshold))
    muon = optax.chain(
        scale_by_muon(c, views(c, spec_tree)), optax.scale_by_learning_rate(schedule)
    )
    chain.append(
        optax.multi_transform({"muon": muon, "adam": adamw, "frozen": optax.set_to_zero()}, marks)
    )
    return optax.chain(*chain)
