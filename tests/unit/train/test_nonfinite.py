"""Non-finite steps: stop by default (naming the step and the key), or skip leaving state intact."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from test_resume import TINY, leaves

from expertax.preflight import load_config
from expertax.train import checkpoint
from expertax.train.loop import train
from expertax.train.step import NonFiniteError
from expertax.train.trainer import build_trainer

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("persistent_compile_cache")]

NAN_STEP = 3


def strict_json(line: str):
    """`json.loads` refusing the bare NaN / Infinity that strict parsers (jq) refuse."""

    def refuse(name: str):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def config(tmp_path, **overrides):
    values = {
        **TINY,
        "base_output_directory": str(tmp_path),
        "steps": 6,
        "checkpoint_period": 1,
        "max_checkpoints": 10,
        "debug_inject_nan_step": NAN_STEP,
        **overrides,
    }
    return load_config(overrides=values)


def test_nonfinite_step_stops_the_run_before_it_is_saved(tmp_path):
    c = config(tmp_path, run_name="stop")
    with pytest.raises(NonFiniteError, match=f"step {NAN_STEP}: non-finite loss nan") as err:
        train(c, echo=lambda *_: None)
    assert "skip_nonfinite_steps=true" in str(err.value)
    with checkpoint.Checkpointer(
        tmp_path / "stop" / "checkpoints", period_steps=1, max_to_keep=10
    ) as ck:
        assert ck.all_steps() == [1, 2, 3]  # the state after the bad step was never saved
    lines = (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()
    assert [strict_json(x)["nonfinite"] for x in lines] == [0, 0, 0, 1]


def test_skip_nonfinite_steps_leaves_the_state_bitwise_unchanged(tmp_path):
    c = config(tmp_path, run_name="skip", skip_nonfinite_steps=True)
    summary = train(c, echo=lambda *_: None)
    assert summary["skipped_steps"] == 1
    records = [
        strict_json(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["skipped_steps"] for r in records] == [0, 0, 0, 1, 1, 1]
    assert [r["nonfinite"] for r in records] == [0, 0, 0, 1, 0, 0]
    # a non-finite loss is written as null (strict JSON, expertax/jsonio.py)
    assert records[NAN_STEP]["loss"] is None and np.isfinite(records[-1]["loss"])

    abstract = build_trainer(c).abstract_state()
    with checkpoint.Checkpointer(
        tmp_path / "skip" / "checkpoints", period_steps=1, max_to_keep=10
    ) as ck:
        before, _ = ck.restore(NAN_STEP, abstract)  # state entering the bad step
        after, data = ck.restore(NAN_STEP + 1, abstract)  # state leaving it
        later, _ = ck.restore(NAN_STEP + 2, abstract)
    assert int(before.step) + 1 == int(after.step) == NAN_STEP + 1
    assert data["skipped_steps"] == 1
    kept = leaves((before.params, before.opt_state, before.rng))
    got = leaves((after.params, after.opt_state, after.rng))
    assert all(np.array_equal(a, b) for a, b in zip(kept, got, strict=True))
    # Negative control: the next (finite) step does change the parameters.
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(leaves(after.params), leaves(later.params), strict=True)
    )
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(leaves(later.params)))
