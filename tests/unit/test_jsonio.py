"""Strict JSON (expertax/jsonio.py): non-finite numbers are written as null, parse with a strict
parser, and read back as not finite; the writers of metrics.jsonl and --json files use it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from expertax import jsonio
from expertax.train.metrics import MetricsWriter

NONFINITE = {
    "nan": math.nan,
    "inf": math.inf,
    "minus_inf": -math.inf,
    "np_nan32": np.float32("nan"),
    "np_inf64": np.float64("inf"),
    "nested": [1.5, {"x": (math.nan, 2)}],
}


def strict_loads(text: str):
    """`json.loads` refusing NaN / Infinity / -Infinity, as jq and JavaScript's JSON.parse do."""

    def refuse(name: str):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_become_null_and_parse_strictly():
    text = jsonio.dumps(NONFINITE)
    assert "NaN" not in text and "Infinity" not in text
    assert strict_loads(text) == {
        "nan": None,
        "inf": None,
        "minus_inf": None,
        "np_nan32": None,
        "np_inf64": None,
        "nested": [1.5, {"x": [None, 2]}],
    }


def test_the_strict_parser_refuses_what_plain_json_writes():
    """Negative control: the standard library's own output fails the strict parser."""
    with pytest.raises(ValueError, match="not strict JSON: NaN"):
        strict_loads(json.dumps({"loss": math.nan}))


def test_finite_values_and_numpy_scalars_keep_their_values():
    values = {"f": 0.1, "i": 7, "b": True, "s": "x", "none": None, "np_f": np.float32(0.5)}
    values |= {"np_i": np.int64(3), "np_big": np.float64(1e300)}
    back = strict_loads(jsonio.dumps(values))
    assert back == {
        "f": 0.1,
        "i": 7,
        "b": True,
        "s": "x",
        "none": None,
        "np_f": 0.5,
        "np_i": 3,
        "np_big": 1e300,
    }
    assert back["b"] is True  # a bool stays a bool, not 1
    ready = jsonio.finite_or_none({"np_i": np.int64(3), "np_f": np.float32(0.5)})
    assert type(ready["np_i"]) is int and type(ready["np_f"]) is float


def test_dump_writes_a_file_that_round_trips_none(tmp_path):
    path = tmp_path / "out.json"
    with open(path, "w") as f:
        jsonio.dump({"loss": math.nan, "kept": None, "steps": [1, math.inf]}, f, indent=1)
    assert strict_loads(path.read_text()) == {"loss": None, "kept": None, "steps": [1, None]}


def test_a_null_number_is_read_back_as_not_finite():
    assert math.isnan(jsonio.number(None))
    assert jsonio.number(2) == 2.0 and math.isfinite(jsonio.number(0.25))


def test_metrics_jsonl_holds_a_nan_loss_as_null(tmp_path):
    """The trainer's writer: a NaN step's record is strict JSON with a null loss."""
    writer = MetricsWriter(tmp_path)
    writer.write({"step": 0, "loss": 2.5, "perplexity": 12.2})
    writer.write({"step": 1, "loss": math.nan, "perplexity": math.nan, "nonfinite": 1})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [strict_loads(line) for line in lines]
    assert records[1] == {"step": 1, "loss": None, "perplexity": None, "nonfinite": 1}
    assert records[0]["loss"] == 2.5
    assert not math.isfinite(jsonio.number(records[1]["loss"]))
