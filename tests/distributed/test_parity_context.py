"""Context parallelism in `expertax parity`: the default matrix's context rows train the same
model as one device, on packed data (documents of every length, segment ids and positions from
0 per document, moved with the tokens by the load-balanced reorder), deepseek3-tiny with MTP
(every row of the matrix) and mixtral-tiny (three rows in the default run:
test_parity_context_mixtral.py; its other two in the extended run; deepseek's other rows on
demand, -m full_grid).

Data seed 1: with seed 0 the second batch holds a token whose top-k experts are a near tie that
the cp2-ep2-fsdp2 layout's float32 rounding flips (the layer outputs differ at that one token
only, and the same layout matches one device on seed 1); the routing probe of the table covers
the first step only (tools/parity/routing.py)."""

from __future__ import annotations

import json

import pytest

from expertax.tools.parity.layouts import context_layouts, parse_layout
from tests.distributed.test_parity import _check_rows, parity_child

pytestmark = pytest.mark.distributed

ROWS = [r.name for r in context_layouts(8)]
COMMON = ["per_device_batch_size=1", "max_target_length=32", "data_shuffle_seed=1"]


def _context_table(model: list[str], layouts: list[str], tmp_path) -> list[dict]:
    path = tmp_path / "parity.json"
    argv = [*model, *COMMON, "--steps", "2", "--packed", "--layouts", ",".join(layouts)]
    run = parity_child(argv, path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Involuntary full rematerialization" not in run.stdout + run.stderr
    report = json.loads(path.read_text())
    assert report["ok"] and report["refused"] == []
    _check_rows(report["rows"], report["tolerance"], 10.0, len(layouts))
    for r in report["rows"]:
        print(f"\ncp{r['cp']} lb={r['load_balance']}: max |dloss| {r['max_abs_loss_diff']:.3g}")
    assert [r["cp"] for r in report["rows"]] == [parse_layout(n).cp for n in layouts]
    # the routing probe reorders like the train step: no expert choice differs at step 0
    # (a pipelined layout is not probed)
    for r in report["rows"]:
        assert r["routing_flips"] is None if r["pp"] > 1 else not any(r["routing_flips"]), r
    return report["rows"]


DEEPSEEK = ["model_name=deepseek3-tiny", "mtp_num_layers=1"]
# the extended run's deepseek rows: the all-to-all dispatch beside FSDP (gathered keys), and the
# pipeline with the ring of experts passing MLA's latent round a ring
# (context_parallel_strategy=ring); mixtral-tiny's rows (test_parity_context_mixtral.py)
# hold the other three layouts the default matrix names, the reorder off in one, and its extended
# rows the pipeline with the default all_gather strategy; deepseek's other rows run on demand
# (-m full_grid), each naming the CI tests that cover it (test_context.py checks both
# strategies and both reorders)
DEFAULT_ROWS = [
    "sparse-padded-cp2-ep2-fsdp2",
    "sparse-ring-pp2-cp2-ep2-cpring",
]


@pytest.mark.extended  # a parity table in a CLI child (20-70 s): CI's second run
def test_context_rows_deepseek3_tiny_with_mtp(tmp_path):
    rows = _context_table(DEEPSEEK, DEFAULT_ROWS, tmp_path)
    assert {r["cp_ring"] for r in rows} == {True, False}


# 135 s: on demand (BENCHMARKS.md holds the table); CI's budget. mixtral-tiny's rows hold these
# layouts (the pipeline with all_gather CP in the extended run), MTP under CP the default rows
@pytest.mark.full_grid
@pytest.mark.covered_by(
    "tests/distributed/test_parity_context.py::test_context_rows_mixtral_tiny_rest",
    "tests/distributed/test_parity_context_mixtral.py::test_context_rows_mixtral_tiny",
    "tests/distributed/test_parity_context.py::test_context_rows_deepseek3_tiny_with_mtp",
)
def test_context_rows_deepseek3_tiny_with_mtp_rest(tmp_path):
    rest = [n for n in ROWS if n not in DEFAULT_ROWS]
    assert len(rest) == 5
    _context_table(DEEPSEEK, rest, tmp_path)


# 90 s: CI's extended run (the default run holds mixtral-tiny's other rows; the pipeline with
# all_gather CP inside its stages runs nowhere else)
@pytest.mark.extended
def test_context_rows_mixtral_tiny_rest(tmp_path):
    layouts = ["sparse-padded-cp2-ep2-fsdp2-nolb", "sparse-ring-pp2-cp2-ep2"]
    _context_table(["model_name=mixtral-tiny"], layouts, tmp_path)
