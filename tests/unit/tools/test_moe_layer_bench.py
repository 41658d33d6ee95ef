"""`benchmarks/moe_layer.py --runs K`: the summary across fresh processes (no timing here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "moe_layer.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("moe_layer_bench", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(**us_by_ep):
    """One run's rows for one case, `ep2=...` -> EP=2; the no-mesh row has EP=1 too."""
    rows = [dict(routing="skewed", strategy="no mesh", routed_ffn="fused", ep=1)]
    rows[0]["us_per_routed_token"] = 4.0
    for name, us in us_by_ep.items():
        rows.append(dict(routing="skewed", strategy="ring", routed_ffn="fused", ep=int(name[2:])))
        rows[-1]["us_per_routed_token"] = us
    return rows


def test_children_get_the_arguments_but_runs_and_json(bench):
    argv = ["--runs", "3", "--ep", "2", "8", "--json=a.json", "--runs=2", "--json", "b", "--iters"]
    assert bench._child_argv([*argv, "5"]) == ["--ep", "2", "8", "--iters", "5"]


def test_summary_takes_each_runs_own_ratio_to_ep2_then_the_median(bench):
    runs = [_rows(ep2=5.0, ep8=6.5), _rows(ep2=6.0, ep8=6.6), _rows(ep2=7.0, ep8=8.75)]
    by = {(r["strategy"], r["ep"]): r for r in bench.summarise_runs(runs)}
    ep8 = by["ring", 8]
    assert ep8["ratio_to_ep2"] == pytest.approx([1.3, 1.1, 1.25])
    # the median of the runs' ratios, not the ratio of the medians (6.6 / 6.0 = 1.1)
    assert ep8["ratio_to_ep2_median"] == pytest.approx(1.25)
    assert (ep8["us_median"], ep8["us_min"], ep8["us_max"]) == (6.6, 6.5, 8.75)
    assert by["ring", 2]["ratio_to_ep2"] is None
    assert by["no mesh", 1]["ratio_to_ep2_median"] is None
