"""The decoder: causality through gradients, scan = unrolled, sharded = one device, learning."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import init_params, load_config, logits
from expertax.models import decoder
from expertax.train import step as step_lib
from expertax.train.trainer import build_trainer
from tests.sharded import on_mesh
from tests.tolerances import tol

SMALL = {"max_target_length": 16, "per_device_batch_size": 1}


def tokens(c, b=2, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, c.max_target_length), 0, c.vocab_size)


@pytest.mark.parametrize("model", ["deepseek3-tiny", "mixtral-tiny", "llama-tiny"])
def test_logits_api_and_causality_through_gradients(model):
    c = load_config(overrides={"model_name": model, **SMALL})
    p = init_params(c)
    toks = tokens(c)
    out = logits(p, toks, c)
    assert out.shape == (2, c.max_target_length, c.vocab_size) and out.dtype == jnp.float32
    x = jnp.take(p.embed, toks, axis=0)
    t = 5

    @jax.jit
    def grad_wrt_inputs(x):
        return jax.grad(lambda x: jnp.sum(decoder.forward_embedded(p, x, c)[0][:, t]))(x)

    g = np.asarray(grad_wrt_inputs(x))
    assert np.all(g[:, t + 1 :] == 0.0)
    assert np.all(np.abs(g[:, : t + 1]).sum(-1) > 0)


def test_documents_do_not_attend_to_each_other():
    c = load_config(overrides={"model_name": "mixtral-tiny", **SMALL})
    p = init_params(c)
    toks = tokens(c, b=1)
    seg = jnp.array([[1] * 6 + [2] * 10], jnp.int32)
    pos = jnp.array([list(range(6)) + list(range(10))], jnp.int32)
    x = jnp.take(p.embed, toks, axis=0)

    def second_doc_loss(x):
        out, _ = decoder.forward_embedded(p, x, c, positions_BT=pos, segment_ids_BT=seg)
        return jnp.sum(out[:, 6:])

    g = np.asarray(jax.jit(jax.grad(second_doc_loss))(x))
    assert np.all(g[:, :6] == 0.0) and np.any(g[:, 6:] != 0.0)


def _loss_and_grads(c, p, batch):
    fn = jax.value_and_grad(lambda p: step_lib.loss_fn(p, batch, c)[0])
    return jax.jit(fn)(p)


def lm_batch(c, b=2):
    toks = tokens(c, b=b, seed=1)
    return {
        "inputs": toks,
        "targets": jnp.roll(toks, -1, axis=1),
        "weights": jnp.ones(toks.shape, jnp.float32),
        "positions": jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape),
        "segment_ids": jnp.ones(toks.shape, jnp.int32),
    }


def test_scan_equals_unrolled():
    c = load_config(overrides=SMALL)
    p = init_params(c)
    batch = lm_batch(c)
    l1, g1 = _loss_and_grads(c, p, batch)
    l2, g2 = _loss_and_grads(c.model_copy(update={"scan_layers": False}), p, batch)
    np.testing.assert_allclose(l1, l2, **tol())
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, **tol())


@pytest.mark.distributed
@pytest.mark.full_grid  # 46 s: on demand (CI's budget; the parity rows train these layouts)
@pytest.mark.covered_by(
    "tests/distributed/test_rules_presets.py::test_preset_trains_the_one_device_model[exp-fsdp]",
    "tests/distributed/test_parity_qwen3.py::test_parity_qwen3_moe_tiny_row",
)
def test_data_fsdp_expert_mesh_equals_one_device():
    overrides = {
        **SMALL,
        "ici_data_parallelism": 2,
        "ici_fsdp_parallelism": 2,
        "ici_expert_parallelism": 2,
    }
    c = load_config(overrides=overrides)
    one = load_config(overrides={**SMALL, "ici_fsdp_parallelism": 1})
    p = init_params(one)
    batch = lm_batch(c, b=8)
    l1, g1 = _loss_and_grads(one, p, batch)
    (l8, g8), ps = on_mesh(c, p, batch, _loss_and_grads)
    assert ps.moe_layers.moe.wi_0.sharding.spec[1] == "expert"
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_thirty_steps_on_one_batch_halve_the_loss():
    c = load_config(
        overrides={
            **SMALL,
            "max_target_length": 32,
            "learning_rate": 3e-3,
            "steps": 30,
            "ici_fsdp_parallelism": 1,
            "per_device_batch_size": 2,
        }
    )
    trainer = build_trainer(c, devices=jax.devices()[:1])
    state = trainer.init_state()
    step = trainer.compile()
    batch = trainer.put_batch({k: np.asarray(v) for k, v in lm_batch(c, b=2).items()})
    losses = []
    with trainer.context():
        for _ in range(30):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
    assert losses[-1] <= 0.5 * losses[0], losses


def test_qk_norm_scales_only_where_configured():
    """attention_qk_norm adds two [Q] scales per layer (axes `layers`, `kv`: replicated like the
    head dim); without it the attention tree is the plain GQA of before, so checkpoints and
    model directories written before the norm existed still restore."""
    from expertax.nn.attention import gqa

    plain = decoder.spec(load_config(overrides={"model_name": "mixtral-tiny"})).moe_layers.attn
    assert type(plain) is gqa.GQA
    flat = jax.tree_util.tree_flatten_with_path(plain, is_leaf=lambda x: x is None)[0]
    assert [path[0].name for path, _ in flat] == ["wq", "wk", "wv", "wo"]
    c = load_config(overrides={"model_name": "qwen3-moe-tiny"})
    normed = decoder.spec(c).moe_layers.attn
    assert type(normed) is gqa.GQA
    flat = jax.tree_util.tree_flatten_with_path(normed, is_leaf=lambda x: x is None)[0]
    assert [path[0].name for path, _ in flat] == ["wq", "wk", "wv", "wo", "q_norm", "k_norm"]
    for s in (normed.q_norm, normed.k_norm):
        assert s.shape == (c.num_moe_layers, c.head_dim) and s.axes == ("layers", "kv")
        assert s.init == "ones" and not s.weight_decay
