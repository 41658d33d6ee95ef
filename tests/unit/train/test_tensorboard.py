"""TensorBoard event files: a non-finite metric (a step whose update was skipped) is left out
without tensorboardX's warning, named once on stderr; the finite values around it are written."""

from __future__ import annotations

import logging
import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from expertax.train.tensorboard import TENSORBOARD_SUBDIR, TensorBoardWriter


def _scalars(path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(path / TENSORBOARD_SUBDIR), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def test_non_finite_values_are_left_out_and_named_once_without_a_warning(tmp_path, capsys, caplog):
    caplog.set_level(logging.WARNING)
    tb = TensorBoardWriter(tmp_path)
    tb.scalars({"step": 0, "loss": 2.0, "grad_norm": 1.0})
    tb.scalars({"step": 1, "loss": math.nan, "grad_norm": math.inf})
    tb.scalars({"step": 2, "loss": -math.inf, "grad_norm": 0.5})
    tb.scalars({"step": 3, "loss": 1.5, "grad_norm": 0.25})
    tb.close()
    assert tb.left_out == 3
    assert [r.getMessage() for r in caplog.records] == []  # tensorboardX's "NaN or Inf found"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("expertax: loss is nan at step 1: "), err
    assert "metrics.jsonl records them as null" in err
    assert _scalars(tmp_path) == {
        "loss": {0: 2.0, 3: 1.5},
        "grad_norm": {0: 1.0, 2: 0.5, 3: 0.25},
    }


def test_finite_values_are_all_written_and_nothing_is_said(tmp_path, capsys, caplog):
    """Negative control: the same records, finite, all reach the event file, silently."""
    caplog.set_level(logging.WARNING)
    tb = TensorBoardWriter(tmp_path)
    for step in range(4):
        tb.scalars({"step": step, "loss": 2.0 - step / 4, "flag": True})  # a bool is no metric
    tb.close()
    assert tb.left_out == 0 and capsys.readouterr().err == "" and caplog.records == []
    assert _scalars(tmp_path) == {"loss": {0: 2.0, 1: 1.75, 2: 1.5, 3: 1.25}}
