"""An imposed routing (`router.route(..., imposed_NK)`): the experts are the imposed ones, the
weights this router's scores of them, the router's own choice comes back beside them; every MoE
path and the decoder's layer scan take it, and without it nothing changes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import init_params
from expertax.models import decoder
from expertax.nn.moe import layer, router
from expertax.nn.moe.side import Side
from expertax.preflight import load_config
from tests.unit.nn.moe.test_moe import setup


def shifted(experts_NK, num_experts):
    """Another valid routing: every expert moved to the next one (still K distinct per token)."""
    return (experts_NK + 1) % num_experts


def test_router_uses_the_imposed_experts_with_its_own_weights():
    c, p, x = setup("deepseek")
    x_ND = x.reshape(-1, c.base_emb_dim)
    own = router.route(p.router, x_ND, c)
    assert own.chosen_NK is None  # nothing imposed: nothing extra
    imposed = shifted(own.experts_NK, c.num_experts).at[:, 0].set(-1)  # slot 0 left free
    r = router.route(p.router, x_ND, c, imposed)
    expected = np.where(np.asarray(imposed) >= 0, np.asarray(imposed), np.asarray(own.experts_NK))
    np.testing.assert_array_equal(r.experts_NK, expected)
    np.testing.assert_array_equal(r.chosen_NK, own.experts_NK)
    scores = np.asarray(jax.nn.sigmoid(x_ND @ p.router.w))
    w = np.take_along_axis(scores, expected, 1)
    w = w / w.sum(1, keepdims=True) * c.routed_scaling_factor
    np.testing.assert_allclose(r.weights_NK, w, rtol=1e-5)
    assert not np.array_equal(r.experts_NK, own.experts_NK)  # the imposition did something


@pytest.mark.parametrize(
    "path", [{"sparse_matmul": True}, {"sparse_matmul": True, "num_moe_token_chunks": 2}, {}]
)
def test_layer_paths_take_the_imposed_routing(path):
    """The sorted path (one chunk and two) and the one-hot einsum path: imposing the router's own
    choice changes nothing; imposing another routing gives the same output on every path."""
    c, p, x = setup("deepseek", capacity_factor=-1.0, sparse_matmul=False)
    cc = c.model_copy(update=path)
    b, t, _ = x.shape
    apply = jax.jit(
        lambda x, r, cfg: layer.apply(p, x, cfg, jnp.float32, Side(imposed=r))[:2], static_argnums=2
    )
    free_out, free_stats, _ = layer.apply(p, x, cc, jnp.float32)
    assert free_stats.chosen_BTK is None
    own_BTK = router.route(p.router, x.reshape(b * t, -1), c).experts_NK.reshape(b, t, -1)
    out, stats = apply(x, own_BTK, cc)
    np.testing.assert_array_equal(stats.chosen_BTK, own_BTK)
    np.testing.assert_allclose(out, free_out, rtol=1e-6, atol=1e-6)
    other_BTK = shifted(own_BTK, c.num_experts)
    out, stats = apply(x, other_BTK, cc)
    np.testing.assert_array_equal(stats.chosen_BTK, own_BTK)  # the router's choice, not used
    einsum_out, _ = apply(x, other_BTK, c)
    np.testing.assert_allclose(out, einsum_out, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(out - free_out)).max() > 1e-2


def test_decoder_scans_one_routing_per_layer():
    """deepseek3-tiny's 2 MoE layers: all -1 gives the plain forward's logits and each layer's
    own choices; imposing those choices back reproduces them; a shifted one changes the logits."""
    c = load_config(overrides={"model_name": "deepseek3-tiny", "max_target_length": 16})
    p = init_params(c)
    toks = jax.random.randint(jax.random.key(0), (2, 16), 0, c.vocab_size)
    fwd = jax.jit(lambda r: decoder.forward(p, toks, c, imposed_LBTK=r))
    plain, stats = jax.jit(lambda: decoder.forward(p, toks, c))()
    assert stats.chosen_BTK is None
    free = jnp.full((2, 2, 16, c.num_experts_per_tok), -1, jnp.int32)
    logits, stats = fwd(free)
    np.testing.assert_allclose(logits, plain, rtol=1e-6, atol=1e-6)
    own = stats.chosen_BTK
    assert own.shape == (2, 2, 16, c.num_experts_per_tok) and int(own.min()) >= 0
    again, stats = fwd(own)
    np.testing.assert_array_equal(stats.chosen_BTK, own)
    np.testing.assert_allclose(again, plain, rtol=1e-6, atol=1e-6)
    moved = own.at[1].set(shifted(own[1], c.num_experts))  # the last layer only
    logits, stats = fwd(moved)
    np.testing.assert_array_equal(stats.chosen_BTK, own)  # earlier layers saw the same inputs
    assert np.abs(np.asarray(logits - plain)).max() > 1e-3
