"""Routing replay for RL on MoE, end to end: `expertax generate --record-routing` on the 8
simulated devices, a toy reward, one train step on one device with the recorded routing imposed
and the advantages as token weights (examples/rl_routing_replay.py), and every refusal.

One train step is compiled (deepseek3-tiny, float32) and run on several batches: the recorded
one (zero flips), the same with the routing moved by one position (the negative control: the
flips metric counts, the loss moves), and its loss checked against a forward pass by hand.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.tolerances import tol

from expertax import load_config
from expertax.config import ConfigError
from expertax.data import rollouts
from expertax.models import decoder
from expertax.nn import vocab_loss
from expertax.train import inputs
from expertax.train.step import imposed_routing

pytestmark = pytest.mark.distributed
EXAMPLE = Path(__file__).parents[3] / "examples" / "rl_routing_replay.py"


def _example():
    spec = importlib.util.spec_from_file_location("rl_routing_replay", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    ex = _example()
    work = tmp_path_factory.mktemp("replay")
    ex.save_model(work / "model")
    rec = ex.sample(work / "model", work / "rollouts.npz")  # the CLI, all 8 devices
    rec = rollouts.with_advantages(rec, ex.score(rec))
    trainer, params, step_fn = ex.make_trainer(work / "model", rec)
    return ex, work, rec, trainer, params, step_fn


def test_the_recording_holds_every_token_of_every_sequence(world):
    ex, _, rec, *_ = world
    c = load_config(overrides=ex.MODEL)
    assert len(rec.rollouts) == len(ex.PROMPTS)
    for prompt, r in zip(ex.PROMPTS, rec.rollouts, strict=True):
        ids = [int(t) for t in prompt.split(",")]
        assert r.tokens[: len(ids)].tolist() == ids and r.prompt_length == len(ids)
        assert len(r.tokens) == len(ids) + ex.NEW_TOKENS
        assert r.routing.shape == (c.num_moe_layers, len(r.tokens), c.num_experts_per_tok)
        assert (r.routing[:, -1] == -1).all()  # the last sampled token is never fed
        fed = r.routing[:, :-1]
        assert fed.min() >= 0 and fed.max() < c.num_experts
        assert (np.sort(fed, -1)[..., 1:] != np.sort(fed, -1)[..., :-1]).all()  # K distinct


def test_replayed_routing_has_no_flips_and_moved_routing_has(world):
    ex, _, rec, trainer, params, step_fn = world
    batch = ex.replay_batch(trainer, rec)
    m = ex.run_step(trainer, params, step_fn, batch)
    assert int(m["routing_replay_flips"]) == 0 and np.isfinite(m["loss"])
    assert float(m["grad_norm"]) > 0
    moved = dict(batch, routing=np.roll(batch["routing"], 1, axis=1))  # one position late
    m2 = ex.run_step(trainer, params, step_fn, moved)
    assert int(m2["routing_replay_flips"]) > 0
    assert abs(float(m2["loss"]) - float(m["loss"])) > 1e-6


def test_the_loss_is_the_advantage_weighted_mean_over_the_sampled_tokens(world):
    ex, _, rec, trainer, params, step_fn = world
    batch = ex.replay_batch(trainer, rec)
    c = trainer.c
    m = ex.run_step(trainer, params, step_fn, batch)

    def by_hand(p, b):
        logits, _ = decoder.forward(
            p,
            b["inputs"],
            c,
            positions_BT=b["positions"],
            segment_ids_BT=b["segment_ids"],
            imposed_LBTK=imposed_routing(b, c),
        )
        w = b["weights"] * b["advantages"]
        return vocab_loss.nll_sum(logits, b["targets"], w) / jnp.sum(b["weights"])

    with trainer.context():
        want = jax.jit(by_hand)(params, jax.tree.map(jnp.asarray, batch))
    np.testing.assert_allclose(float(m["loss"]), float(want), **tol())
    # the advantages are not all one: the mask-only loss is another number
    assert np.ptp(batch["advantages"][batch["weights"] > 0]) > 0


def test_a_row_that_was_not_recorded_is_refused(world):
    _, work, rec, *_ = world
    other = rec.rollouts[0].tokens.copy()
    other[-1] = (other[-1] + 1) % 17
    with pytest.raises(ConfigError, match="batch row 1 .* is not a recorded sequence"):
        rollouts.match(rec, [rec.rollouts[0].tokens, other])
    with pytest.raises(ConfigError, match=r"\(num_moe_layers, num_experts_per_tok, num_experts"):
        rollouts.check_model(rec, rec.num_moe_layers + 1, 4, rec.num_experts, "test")
    with pytest.raises(ConfigError, match="set max_target_length=.* or more"):
        rollouts.batch(rec.rollouts, 4)
    with pytest.raises(ConfigError, match="advantage rows for"):
        rollouts.with_advantages(rec, [[0.0]])
    bad = work / "bad.npz"
    np.savez(bad, tokens_0=np.zeros(3, np.int32))
    with pytest.raises(ConfigError, match="not an expertax-rollouts-1 file"):
        rollouts.read(bad)


def test_the_file_round_trips(world, tmp_path):
    _, _, rec, *_ = world
    rollouts.write(tmp_path / "r.npz", rec)
    back = rollouts.read(tmp_path / "r.npz")
    assert len(back.rollouts) == len(rec.rollouts)
    for a, b in zip(rec.rollouts, back.rollouts, strict=True):
        np.testing.assert_array_equal(a.routing, b.routing)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.advantages, b.advantages)


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(ici_pipeline_parallelism=2), "the MoE layers are pipelined"),
        (
            dict(moe_paged_stash=True, remat_policy="minimal"),
            "moe_paged_stash=true takes no imposed routing",
        ),
        (dict(sparse_matmul=False, capacity_factor=1.5), "capacity_factor=1.5 drops"),
        (dict(model_name="llama-tiny"), "the model has no MoE layers"),
    ],
)
def test_layouts_that_cannot_impose_a_routing_are_refused(keys, message):
    keys = {"model_name": "deepseek3-tiny", **keys, "routing_replay": True}
    with pytest.raises(ConfigError, match=f"routing_replay=true: {message}"):
        load_config(overrides=keys)
    load_config(overrides={**keys, "routing_replay": False})  # the layout alone is valid


@pytest.mark.parametrize("key", ["routing_replay", "token_advantages"])
def test_the_train_loops_data_has_no_rollouts(key):
    c = load_config(overrides={"model_name": "deepseek3-tiny", key: True})
    with pytest.raises(ConfigError, match=f"{key}=true: dataset_type=synthetic has no"):
        inputs.check_rollout_fields(c)
    inputs.check_rollout_fields(load_config(overrides={"model_name": "deepseek3-tiny"}))
