"""Multi-token prediction (models/mtp.py): the loss and its gradients against a plainly written
oracle (a loop over depths, per-position gathers, no shifts, no scan), targets that never cross a
document boundary or padding, and a short training run that reports it and updates the MTP
block's routing bias."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import init_params, load_config
from expertax.data.synthetic import SyntheticData
from expertax.models import decoder, mtp
from expertax.nn import param
from expertax.planner import estimate
from expertax.tools import report
from expertax.train import metrics as metrics_lib
from expertax.train import step as step_lib
from expertax.train.evaluate import Evaluator
from expertax.train.trainer import build_trainer
from tests.conftest import TINY_MOE
from tests.tolerances import tol

B, T = 2, 16


def _config(model: str, depth: int, **over):
    keys = dict(
        model_name=model,
        max_target_length=T,
        per_device_batch_size=1,
        dtype="float32",
        weight_dtype="float32",
        mtp_num_layers=depth,
        load_balance_loss_weight=0.0,
    )
    if depth:  # the weight applies only with MTP modules (without them it is refused)
        keys["mtp_loss_scaling_factor"] = 0.3
    return load_config(overrides={**keys, **over})


def _batch(c, packed: bool) -> dict:
    keys = jax.random.split(jax.random.key(3), 2)
    inputs = jax.random.randint(keys[0], (B, T), 0, c.vocab_size)
    targets = jax.random.randint(keys[1], (B, T), 0, c.vocab_size)
    batch = {"inputs": inputs, "targets": targets, "weights": jnp.ones((B, T), jnp.float32)}
    if packed:  # two documents in row 0, one and padding in row 1
        seg = np.array([[1] * 6 + [2] * 10, [1] * 12 + [0] * 4], np.int32)
        pos = np.array([list(range(6)) + list(range(10)), list(range(12)) + [0] * 4], np.int32)
        batch.update(
            segment_ids=jnp.asarray(seg),
            positions=jnp.asarray(pos),
            weights=jnp.asarray((seg > 0).astype(np.float32)),
        )
    return batch


def _rms(scale, x, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale[None, None]


def oracle_loss(p: decoder.Decoder, batch: dict, c):
    """Main cross-entropy + lambda / D x sum_k CE_k, the MTP part written out: for depth k and
    position i, the token and the target k positions ahead by index, counted when that
    position is a target of the same document. Also (aux) the depth-1 head's top-1 hits and the
    positions counted."""
    eps = c.normalization_layer_epsilon
    seg, pos = batch.get("segment_ids"), batch.get("positions")
    h, _ = decoder.hidden_states(
        p, jnp.take(p.embed, batch["inputs"], axis=0), c, positions_BT=pos, segment_ids_BT=seg
    )
    head = p.embed.T if p.lm_head is None else p.lm_head

    def ce(x, targets, w):
        logp = jax.nn.log_softmax(x @ head, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)

    total = ce(h, batch["targets"], batch["weights"])
    if pos is None:
        pos = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    mtp_sum, hits = 0.0, None
    for k in range(1, c.mtp_num_layers + 1):
        layer = jax.tree.map(lambda a, k=k: a[k - 1], p.mtp)
        ahead = np.minimum(np.arange(T) + k, T - 1)
        exists = jnp.asarray(np.arange(T) + k < T, jnp.float32)[None]
        tokens, targets = batch["inputs"][:, ahead], batch["targets"][:, ahead]
        w = batch["weights"][:, ahead] * exists
        if seg is not None:
            w = w * (seg[:, ahead] == seg)
        e = jnp.take(p.embed, tokens, axis=0)
        x = jnp.concatenate([_rms(layer.enorm, e, eps), _rms(layer.hnorm, h, eps)], -1)
        h, *_ = decoder.block_apply(layer.block, x @ layer.eh_proj, c, pos, seg, jnp.float32)
        out = _rms(layer.head_norm, h, eps)
        mtp_sum = mtp_sum + ce(out, targets, w)
        if hits is None:
            hits = (jnp.sum((jnp.argmax(out @ head, -1) == targets) * w), jnp.sum(w))
    return total + c.mtp_loss_scaling_factor * mtp_sum / c.mtp_num_layers, hits


# the last case: vocab tiles (the loss and the acceptance), MoE token chunks, unscanned main
# layers and full recompute
OTHER_PATHS = dict(num_vocab_tiling=4, num_moe_token_chunks=2, scan_layers=False)
_HERE = "tests/unit/models/test_mtp.py::test_mtp_loss_and_gradients_equal_the_oracle"


@pytest.mark.parametrize(
    "model,depth,packed,over",
    [
        # depth 1 on demand (-m full_grid): depth 2 runs the first depth's code too
        pytest.param(
            "deepseek3-tiny",
            1,
            False,
            {},
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(f"{_HERE}[deepseek3-tiny-2-True-over1]"),
            ],
        ),
        ("deepseek3-tiny", 2, True, {}),
        pytest.param(
            "mixtral-tiny",
            1,
            True,
            {},
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(f"{_HERE}[mixtral-tiny-2-False-over3]"),
            ],
        ),
        ("mixtral-tiny", 2, False, dict(OTHER_PATHS, remat_policy="full")),
    ],
)
def test_mtp_loss_and_gradients_equal_the_oracle(model, depth, packed, over):
    c = _config(model, depth, **over)
    p = init_params(c)
    # non-trivial norm scales, so that a swapped or missing norm shows
    keys = iter(jax.random.split(jax.random.key(7), 3))
    noisy = {
        n: getattr(p.mtp, n) + 0.3 * jax.random.normal(next(keys), getattr(p.mtp, n).shape)
        for n in ("enorm", "hnorm", "head_norm")
    }
    p = dataclasses.replace(p, mtp=dataclasses.replace(p.mtp, **noisy))
    batch = _batch(c, packed)
    got, got_g = jax.jit(jax.value_and_grad(lambda p: step_lib.loss_fn(p, batch, c)[0]))(p)
    (want, want_hits), want_g = jax.jit(
        jax.value_and_grad(lambda p: oracle_loss(p, batch, c), has_aux=True)
    )(p)
    np.testing.assert_allclose(float(got), float(want), **tol())
    parts = jax.jit(lambda p: step_lib.loss_fn(p, batch, c, acceptance=True)[1])(p)
    assert float(got) > float(parts.ce)
    assert [float(x) for x in parts.mtp_accepted] == [float(x) for x in want_hits]
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol())
    # every MTP parameter gets a gradient
    assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(got_g.mtp.block.attn))


def test_depth_targets_stop_at_documents_padding_and_the_end():
    c = _config("mixtral-tiny", 2)
    batch = _batch(c, packed=True)
    for k in (1, 2):
        tokens, targets, w = (np.asarray(a) for a in mtp.depth_targets(batch, k))
        seg = np.asarray(batch["segment_ids"])
        for b in range(B):
            for i in range(T):
                j = i + k
                valid = j < T and seg[b, j] == seg[b, i] and seg[b, j] > 0
                assert w[b, i] == float(valid), (k, b, i)
                if valid:
                    assert tokens[b, i] == batch["inputs"][b, j]
                    assert targets[b, i] == batch["targets"][b, j]
    # row 0: document 1 ends at 5, so depth 1 has no target at 5 and depth 2 none at 4 and 5
    assert np.asarray(mtp.depth_targets(batch, 1)[2])[0, 5] == 0
    assert np.asarray(mtp.depth_targets(batch, 2)[2])[0, 4:6].tolist() == [0, 0]


def test_a_step_with_mtp_reports_it_and_updates_the_mtp_routing_bias():
    """The train step's metrics carry mtp_loss, the MTP block's routing bias moves from zero
    (its own load's update), and evaluation reports the MTP loss and the depth-1 acceptance."""
    c = load_config(overrides=dict(TINY_MOE, steps=3, mtp_num_layers=1, eval_steps=1))
    tr = build_trainer(c, devices=jax.devices()[:8])
    state = tr.init_state()
    fn = tr.compile()
    data = SyntheticData(
        vocab_size=c.vocab_size, seq_len=c.max_target_length, global_batch=8, seed=0
    )
    with tr.context():
        state, m = fn(state, tr.put_batch(data.batch_at(0)))
    assert np.isfinite(float(m["mtp_loss"])) and float(m["mtp_loss"]) > 0
    bias = np.asarray(state.params.mtp.block.moe.router.bias)
    assert bias.shape == (1, c.num_experts) and np.abs(bias).sum() > 0
    ev = Evaluator(c, tr, data).run(state.params)
    assert 0.0 <= ev["eval_mtp_acceptance"] <= 1.0 and np.isfinite(ev["eval_mtp_loss"])


def test_the_planner_counts_the_mtp_modules():
    """The fit search's estimate holds the MTP modules' parameters, their gradients and optimizer
    state, and their blocks' saved activations (one more MoE block's worth per depth)."""
    shape = {"pipeline": 1, "data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
    base = {"sharding_rules": "default", "remat_policy": "minimal", "num_vocab_tiling": 1}
    without, with_mtp = (
        estimate.Estimator(_config("deepseek3-tiny", d, per_device_batch_size=2)) for d in (0, 2)
    )
    elems = [e.state_bytes(shape, "default")[0] for e in (without, with_mtp)]
    mtp_elems = param.count(param.stack(decoder.mtp_spec(with_mtp.c), 2))
    assert elems[1] - elems[0] >= mtp_elems // 8  # sharded over fsdp=8 (norms replicated)
    keys = {"remat_policy": "minimal", "attention_impl": "dot"}
    saved = [sum(e.residual_bytes(keys)[0].values()) for e in (without, with_mtp)]
    per_moe_layer = saved[0] - sum(
        estimate.Estimator(_config("deepseek3-tiny", 0, base_num_decoder_layers=2))
        .residual_bytes(keys)[0]
        .values()
    )
    assert per_moe_layer > 0 and saved[1] - saved[0] == 2 * per_moe_layer
    assert with_mtp.estimate(base, shape) > without.estimate(base, shape)
    # the model FLOPs (tflops_per_device, MFU) count the depth's block, projection and head
    c0, c2 = without.c, with_mtp.c
    d, v = c0.base_emb_dim, c0.vocab_size
    one_layer = metrics_lib.train_flops_per_token(
        c0.model_copy(update={"base_num_decoder_layers": 4})
    ) - metrics_lib.train_flops_per_token(c0)
    extra = metrics_lib.train_flops_per_token(c2) - metrics_lib.train_flops_per_token(c0)
    assert extra == pytest.approx(2 * (one_layer + 6 * (2 * d * d + d * v)))


def test_the_console_lines_and_the_report_show_the_mtp_loss():
    rec = dict(
        step=3,
        loss=2.5,
        perplexity=12.2,
        lb_loss=0.0,
        mtp_loss=3.25,
        dropped_tokens=0,
        step_time_s=0.1,
        tokens_per_s_per_device=10.0,
        tflops_per_device=0.0,
    )
    assert "| mtp 3.2500 |" in metrics_lib.console_line(rec)
    plain = {k: v for k, v in rec.items() if k != "mtp_loss"}
    assert "mtp" not in metrics_lib.console_line(plain)
    ev = dict(rec, eval_loss=2.0, eval_perplexity=7.4, eval_tokens=64)
    ev.update(eval_mtp_loss=3.0, eval_mtp_acceptance=0.25)
    assert "mtp loss 3.0000, acceptance 0.250" in metrics_lib.eval_console_line(ev)
    summary = report.summarize({}, [rec, ev])
    assert summary["final eval MTP acceptance"] == 0.25 and summary["final eval MTP loss"] == 3.0
