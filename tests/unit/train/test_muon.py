"""Muon (`opt_type=muon`): its update against optax's `contrib.muon`, which leaves it takes, how
it reads a leaf as matrices, and the layout that orthogonalises each matrix whole on one device
(`train/muon_layout.py`) against the same update without a mesh."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers
from optax.contrib import muon as optax_muon
from tests.tolerances import tol

from expertax.config import ConfigError
from expertax.models import decoder
from expertax.nn import param
from expertax.preflight import load_config
from expertax.sharding import use_rules
from expertax.train import muon, muon_layout, optimizer

PRESETS = sorted(p.stem for p in (Path(__file__).parents[3] / "configs" / "models").glob("*.yml"))
MUON = {"model_name": "mixtral-tiny", "opt_type": "muon", "steps": 10}

# a dense matrix [D, F], an expert stack [L, E, D, F] and an attention output [H, K, D]
SPECS = {
    "dense": param.projection((64, 32), ("embed", "mlp"), 64),
    "experts": param.stack(param.projection((4, 32, 48), ("exp", "exp_embed", "exp_mlp"), 32), 2),
    "out": param.projection((4, 8, 64), ("heads", "kv", "embed"), 32),
    "norm": param.ParamSpec((32,), (None,), "ones", weight_decay=False),
}
OPTAX_DIMS = {
    "dense": MuonDimensionNumbers(0, 1),
    "experts": MuonDimensionNumbers(2, 3),
    "out": MuonDimensionNumbers((0, 1), 2),
    "norm": None,
}


def _grads(step: int, params):
    keys = jax.random.split(jax.random.key(100 + step), len(jax.tree.leaves(params)))
    leaves, tree = jax.tree.flatten(params)
    return tree.unflatten(
        [jax.random.normal(k, p.shape, jnp.float32) for k, p in zip(keys, leaves, strict=True)]
    )


@pytest.mark.parametrize("consistent_rms", [0.2, 0.0])
def test_update_equals_optax_contrib_muon(consistent_rms):
    """Four steps of our Muon and of optax's on the same parameters and gradients (float32,
    clipping off): the Muon leaves' updates agree within float32's tolerance, both with the
    consistent-RMS scaling (Moonlight's rule, optax's `consistent_rms`) and with the width
    scaling (optax's None, our 0)."""
    c = load_config(
        overrides={
            **MUON,
            "gradient_clipping_threshold": 0.0,
            "muon_consistent_rms": consistent_rms,
        }
    )
    ours = optimizer.make(c, SPECS)
    ref = optax_muon(
        optimizer.schedule(c),
        beta=c.muon_beta,
        weight_decay=c.muon_weight_decay,
        consistent_rms=consistent_rms or None,
        adam_b1=c.adam_b1,
        adam_b2=c.adam_b2,
        adam_weight_decay=c.adam_weight_decay,
        muon_weight_dimension_numbers=OPTAX_DIMS,
    )
    params = param.initialize(SPECS, jax.random.key(0), jnp.float32)
    state_a, state_b, p_a, p_b = ours.init(params), ref.init(params), params, params
    for step in range(4):
        g = _grads(step, params)
        u_a, state_a = ours.update(g, state_a, p_a)
        u_b, state_b = ref.update(g, state_b, p_b)
        for name in ("dense", "experts", "out"):
            assert step == 0 or float(jnp.max(jnp.abs(u_b[name]))) > 1e-4  # lr(0) = 0
            np.testing.assert_allclose(u_a[name], u_b[name], **tol())
        p_a, p_b = optax.apply_updates(p_a, u_a), optax.apply_updates(p_b, u_b)


def test_newton_schulz_orthogonalises_each_matrix_of_a_batch():
    """Each matrix of a batch comes out with its singular values near 1 (the quintic iteration
    leaves them in about [0.7, 1.2]), tall and wide alike, and the same as alone."""
    x = jax.random.normal(jax.random.key(1), (3, 24, 40), jnp.float32)
    for y in (x, jnp.swapaxes(x, 1, 2)):
        o = muon.newton_schulz(y, 5)
        s = np.linalg.svd(np.asarray(o), compute_uv=False)
        assert s.min() > 0.5 and s.max() < 1.3, (s.min(), s.max())
        np.testing.assert_allclose(o[1], muon.newton_schulz(y[1:2], 5)[0], **tol())


@pytest.mark.parametrize("model", PRESETS)
def test_which_leaves_muon_takes(model):
    """Projections are Muon's (the router's too unless muon_include_routers=false); the
    embedding, output head, norms, biases and sinks are AdamW's; frozen leaves (the DeepSeek
    routing bias) neither. Every Muon leaf reads as matrices whose rows multiply to fan_in."""
    c = load_config(overrides={"model_name": model, "opt_type": "muon"})
    spec = decoder.spec(c)
    labels = muon.labels(c, spec)
    flat = jax.tree_util.tree_flatten_with_path(spec, is_leaf=param.is_spec)[0]
    marks = jax.tree.leaves(labels)
    assert len(marks) == len(flat)
    for (path, s), mark in zip(flat, marks, strict=True):
        name = jax.tree_util.keystr(path)
        if not s.trainable:
            assert mark == "frozen", name
        elif s.fan_in and "vocab" not in s.axes:
            assert mark == "muon", name
            v = muon.view(s, name)
            _, rows, cols = v.sizes(s.shape)
            assert rows == s.fan_in and rows * cols * v.sizes(s.shape)[0] == np.prod(s.shape)
        else:
            assert mark == "adam", name
    assert "muon" in marks and "adam" in marks
    no_router = load_config(
        overrides={"model_name": model, "opt_type": "muon", "muon_include_routers": False}
    )
    routers = [
        m
        for (path, _), m in zip(flat, jax.tree.leaves(muon.labels(no_router, spec)), strict=True)
        if "router" in jax.tree_util.keystr(path) and path[-1].name == "w"
    ]
    assert set(routers) <= {"adam"}


def test_views_of_the_stacks():
    """An expert stack [L, E, D, F] is L x E matrices D x F; an attention output [L, H, K, D]
    is L matrices (H K) x D; a projection whose fan_in no leading axes give is refused."""
    experts = param.stack(param.projection((4, 32, 48), ("exp", "exp_embed", "exp_mlp"), 32), 2)
    assert muon.view(experts) == muon.View(2, 1, True, experts.axes)
    assert muon.View(2, 1).sizes(experts.shape) == (8, 32, 48)
    out = param.stack(param.projection((4, 8, 64), ("heads", "kv", "embed"), 32), 3)
    assert muon.View(1, 2).sizes(out.shape) == (3, 32, 64)
    assert muon.view(out).rows == 2
    with pytest.raises(ValueError, match="fan_in 5"):
        muon.view(param.projection((4, 8), ("embed", "mlp"), 5), "w")


def test_muon_keys_need_opt_type_muon():
    """A Muon key given with AdamW would be ignored: refused, naming the key and the setting."""
    with pytest.raises(ConfigError, match="muon_beta.*opt_type=muon"):
        load_config(overrides={"model_name": "mixtral-tiny", "muon_beta": 0.9})


def _mesh():
    devices = np.asarray(jax.devices()[:8]).reshape(2, 2, 2)
    return jax.sharding.Mesh(devices, ("fsdp", "expert", "tensor"), axis_types=(AxisType.Auto,) * 3)


RULES = {
    "layers": (),
    "exp": ("expert",),
    "exp_embed": ("fsdp",),
    "exp_mlp": ("tensor",),
    "embed": ("fsdp", "tensor"),
    "mlp": (),
    "heads": ("tensor",),
    "kv": (),
}


def test_layout_moves_matrix_splits_to_the_batch():
    """An expert stack stored [L, E/expert, D/fsdp, F/tensor] moves tensor then fsdp to its
    batch of matrices (all-to-alls, minor axis first, no gather); a layer stack stored
    [L, D/(fsdp, tensor), F] moves both axes the same way (padded: 3 layers do not divide by
    2); a leaf replicated over an axis takes its slice there."""
    with jax.set_mesh(_mesh()), use_rules(RULES):
        layout = muon_layout.plan((4, 8, 32, 48), ("layers", "exp", "exp_embed", "exp_mlp"), 2)
        assert layout is not None
        assert layout.stored == P(None, "expert", "fsdp", "tensor")
        assert layout.steps == (("move", "fsdp", 2), ("move", "tensor", 3))
        dense = muon_layout.plan((3, 32, 48), ("layers", "embed", "mlp"), 1)
        assert dense is not None and dense.stored == P(None, ("fsdp", "tensor"), None)
        assert dense.steps == (("move", "tensor", 1), ("move", "fsdp", 1), ("slice", "expert"))


@pytest.mark.parametrize(
    ("shape", "axes", "batch"),
    [
        ((4, 8, 32, 48), ("layers", "exp", "exp_embed", "exp_mlp"), 2),
        ((3, 32, 48), ("layers", "embed", "mlp"), 1),
        ((2, 4, 8, 32), ("layers", "heads", "kv", "embed"), 1),
        ((32, 16), ("embed", "mlp"), 0),
        ((3, 5, 32, 16), ("layers", "exp", "exp_embed", "exp_mlp"), 2),
    ],
)
def test_orthogonalised_in_the_layout_equals_without_a_mesh(shape, axes, batch):
    """Newton-Schulz through the layout (sharded storage, collectives, back) gives what it
    gives on the whole leaf without a mesh, in the leaf's storage sharding."""
    x = jax.random.normal(jax.random.key(2), shape, jnp.float32)
    rows = 2 if axes[batch] == "heads" else 1
    v = muon.View(batch, rows, True, axes)
    want = muon.orthogonalize(x, v, 5, jnp.float32)
    mesh = _mesh()
    with jax.set_mesh(mesh), use_rules(RULES):
        stored = muon_layout.plan(shape, axes, batch)
        assert stored is not None
        x_sharded = jax.device_put(x, NamedSharding(mesh, stored.stored))
        run = jax.jit(lambda y: muon.orthogonalize(y, v, 5, jnp.float32, axes))
        got = run(x_sharded)
        hlo = run.lower(x_sharded).compile().as_text()
    assert got.sharding.spec == stored.stored
    if shape == (4, 8, 32, 48):  # split on every axis: moved by all-to-alls, never gathered
        assert "all-to-all" in hlo and "all-gather" not in hlo
    np.testing.assert_allclose(got, want, **tol())
