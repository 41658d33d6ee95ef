"""Seeing a run: held-out evaluation, TensorBoard event files, per-layer expert loads, profiles.

One short run (module fixture) is inspected by most tests; the resume test trains its own.
"""

from __future__ import annotations

import gzip
import json

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tests.conftest import TINY_MOE
from tests.tolerances import tol
from tests.unit.train.test_resume import assert_bitwise_equal, read_metrics

from expertax.config import ConfigError
from expertax.data.synthetic import SyntheticData
from expertax.preflight import load_config
from expertax.train import inputs
from expertax.train.loop import train
from expertax.train.step import loss_fn
from expertax.train.tensorboard import TENSORBOARD_SUBDIR

pytestmark = pytest.mark.distributed

OBSERVED = dict(
    TINY_MOE,
    base_num_decoder_layers=2,
    steps=6,
    log_period=2,
    eval_interval=4,
    eval_steps=2,
    profiler="xplane",
    skip_first_n_steps_for_profiler=2,
    profiler_steps=1,
    enable_checkpointing=False,
)


@pytest.fixture(scope="module", autouse=True)
def _cache(persistent_compile_cache):
    yield


def config(tmp_path, **overrides):
    return load_config(overrides={**OBSERVED, "base_output_directory": str(tmp_path), **overrides})


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """(config, summary, metrics records) of the short observed run."""
    c = config(tmp_path_factory.mktemp("observe"), run_name="observed")
    summary = train(c, echo=lambda *_: None)
    return c, summary, read_metrics(summary["run_dir"])


def hand_eval_loss(c, params, seed: int) -> float:
    """sum_b ce_b * w_b / sum_b w_b over the first eval_steps batches of the stream `seed`,
    with a plain jitted loss_fn on replicated arrays."""
    data = SyntheticData(
        vocab_size=c.vocab_size,
        seq_len=c.max_target_length,
        global_batch=8 * int(c.per_device_batch_size),
        seed=seed,
    )
    forward = jax.jit(lambda p, b: loss_fn(p, b, c)[1][0])
    params = jax.device_put(params, jax.devices()[0])
    num = den = 0.0
    for i in range(c.eval_steps):
        batch = data.batch_at(i)
        w = float(batch["weights"].sum())
        num += float(forward(params, batch)) * w
        den += w
    return num / den


def test_eval_loss_equals_a_hand_run_forward_on_the_held_out_batches(observed):
    c, summary, records = observed
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 5]  # after 4 steps, and after the last
    last = evals[-1]
    held_out = c.data_shuffle_seed + inputs.EVAL_SEED_OFFSET
    expected = hand_eval_loss(c, summary["state"].params, held_out)
    np.testing.assert_allclose(last["eval_loss"], expected, **tol())
    assert last["eval_perplexity"] == pytest.approx(np.exp(last["eval_loss"]))
    assert last["eval_tokens"] == c.eval_steps * 8 * c.max_target_length
    # Negative control: the training stream gives another loss, so the check can fail.
    on_train = hand_eval_loss(c, summary["state"].params, c.data_shuffle_seed)
    assert abs(on_train - expected) > 1e3 * tol()["atol"]
    # The training data position is untouched by the evaluations.
    assert summary["data_state"] == {"step": c.steps}
    assert summary["final_eval_loss"] == last["eval_loss"]


def test_expert_loads_per_layer_in_metrics_at_log_period(observed):
    c, _, records = observed
    logged = {r["step"]: r["expert_load"] for r in records if "expert_load" in r}
    assert sorted(logged) == [0, 2, 4, 5]  # every log_period steps, and the last step
    tokens_times_k = 8 * c.max_target_length * c.num_experts_per_tok
    for load in logged.values():
        assert np.shape(load) == (c.num_moe_layers, c.num_experts)
        assert all(sum(layer) == tokens_times_k for layer in load)  # every assignment counted
    ratio = max(max(x) / np.mean(x) for x in logged[0])
    assert ratio == pytest.approx(records[0]["max_expert_load_ratio"], rel=1e-6)


def _events(run_dir) -> EventAccumulator:
    acc = EventAccumulator(
        str(run_dir / TENSORBOARD_SUBDIR), size_guidance={"scalars": 0, "histograms": 0}
    )
    return acc.Reload()


def test_tensorboard_events_hold_the_metrics_loads_and_config(observed):
    from pathlib import Path

    c, summary, records = observed
    acc = _events(Path(summary["run_dir"]))
    tags = acc.Tags()
    for key in ("loss", "learning_rate", "grad_norm", "step_time_s", "eval_loss", "lb_loss"):
        assert key in tags["scalars"], key
    loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert loss == pytest.approx({r["step"]: r["loss"] for r in records}, rel=1e-6)
    lr = {e.step: e.value for e in acc.Scalars("learning_rate")}
    assert lr == pytest.approx({r["step"]: r["learning_rate"] for r in records}, rel=1e-6)
    assert [e.step for e in acc.Scalars("eval_loss")] == [3, 5]
    by_step = {r["step"]: r for r in records}
    for layer in range(c.num_moe_layers):
        hist = {e.step: e.histogram_value for e in acc.Histograms(f"expert_load/layer_{layer}")}
        assert sorted(hist) == [0, 2, 4, 5]
        for step, h in hist.items():
            assert list(h.bucket) == by_step[step]["expert_load"][layer]
            assert list(h.bucket_limit) == list(range(1, c.num_experts + 1))
        zeros = acc.Scalars(f"experts_without_tokens/layer_{layer}")
        assert [e.value for e in zeros] == [
            sum(1 for x in by_step[s]["expert_load"][layer] if x == 0) for s in (0, 2, 4, 5)
        ]
        top = acc.Scalars(f"expert_load_max_over_mean/layer_{layer}")[0].value
        load0 = by_step[0]["expert_load"][layer]
        assert top == pytest.approx(max(load0) / np.mean(load0), rel=1e-6)
    assert not any(t.startswith("device_memory/") for t in tags["scalars"])  # CPU: no stats
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert f"num_experts: {c.num_experts}" in text


def test_tensorboard_off_writes_no_event_files(tmp_path):
    c = config(tmp_path, run_name="quiet", enable_tensorboard=False, profiler="")
    summary = train(c, echo=lambda *_: None)
    from pathlib import Path

    run_dir = Path(summary["run_dir"])
    assert (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / TENSORBOARD_SUBDIR).exists()


def test_profile_folder_holds_a_trace(observed):
    from pathlib import Path

    _, summary, _ = observed
    profile = Path(summary["run_dir"]) / "profile"
    xplanes = list(profile.glob("plugins/profile/*/*.xplane.pb"))
    assert len(xplanes) == 1 and xplanes[0].stat().st_size > 1000
    traces = list(profile.glob("plugins/profile/*/*.trace.json.gz"))
    assert traces
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    assert any("jit" in str(e.get("name", "")) for e in events)  # the step's computation


def test_resume_with_evaluation_is_bitwise(tmp_path):
    quiet = dict(echo=lambda *_: None)
    keys = dict(eval_interval=2, checkpoint_period=3, enable_checkpointing=True)
    keys.update(profiler="", enable_tensorboard=False)
    straight = train(config(tmp_path, run_name="straight", **keys), **quiet)
    train(config(tmp_path, run_name="resumed", **keys), stop_after_step=4, **quiet)
    resumed = train(config(tmp_path, run_name="resumed", **keys), **quiet)
    assert resumed["resumed_from"] == 4
    assert_bitwise_equal(straight["state"], resumed["state"])
    assert straight["data_state"] == resumed["data_state"]
    a, b = read_metrics(straight["run_dir"]), read_metrics(resumed["run_dir"])
    eval_a = [(r["step"], r["eval_loss"]) for r in a if "eval_loss" in r]
    eval_b = [(r["step"], r["eval_loss"]) for r in b if "eval_loss" in r]
    assert eval_a == eval_b and [s for s, _ in eval_a] == [1, 3, 5]


def test_config_checks_name_the_keys():
    with pytest.raises(ConfigError, match="eval_dataset_path=.*tokenizer_path"):
        load_config(overrides={"eval_dataset_path": "held_out.jsonl"})
    with pytest.raises(ConfigError, match="skip_first_n_steps_for_profiler=5 and steps=5"):
        load_config(
            overrides={"profiler": "xplane", "steps": 5, "skip_first_n_steps_for_profiler": 5}
        )
    with pytest.raises(ConfigError, match="profiler='perfetto'"):
        load_config(overrides={"profiler": "perfetto"})
