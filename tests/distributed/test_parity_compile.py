"""`expertax parity --compile-only`: layouts compiled, nothing run, for the 8 simulated CPU devices
and (without the hardware) for a TPU v5p slice and 8 H100s. A few representative layouts per
target here (a compile takes 5-20 s); every layout of the default matrix:
test_parity_compile_matrix.py (on demand, -m compile_matrix)."""

from __future__ import annotations

import json

import pytest

from expertax import cli
from expertax.targets import compiler_available

pytestmark = pytest.mark.distributed

TINY = ["model_name=deepseek3-tiny", "max_target_length=32"]
# One all-to-all layout (no implementation named: the target's own) and one ring; the pipelined
# all-to-all layout (the exchange inside the stages) in a test of its own. The default run
# compiles the all-to-all layout for the TPU slice (the ring's program holds no exchange a
# target implements differently: XLA:CPU's rows run it); both layouts on both targets on demand.
REPRESENTATIVE = {"sparse-ep8": "ragged", "sparse-ring-ep4-fsdp2": "-"}
PIPELINE = "sparse-ragged-pp2-ep2-fsdp2"


def compile_only(tmp_path, *args) -> tuple[int, dict]:
    path = tmp_path / "compile.json"
    rc = cli.main(["parity", "--compile-only", *args, "--json", str(path)])
    return rc, json.loads(path.read_text())


def check_row(row: dict) -> None:
    """A compiled row: its figures, and the exchange its layout asks for in the program."""
    assert row["status"] == "yes" and row["ok"], row
    assert row["a2a"] == row["a2a_expected"]
    assert 0 < row["peak_device_bytes"] < 2**30
    assert row["model_flops"] > 0 and "flops_ratio" in row and "compiled_flops" in row
    if row["a2a_expected"] == "ragged":
        assert row["collectives"]["ragged-all-to-all"] > 0 and row["padded_exchange"] == 0
    elif row["a2a_expected"] == "padded":
        assert row["padded_exchange"] > 0 and "ragged-all-to-all" not in row["collectives"]
    else:
        assert row["padded_exchange"] == 0


# on demand (CI's budget: the TPU target's row below runs the compile-only path by default; the
# padded exchange's detection and a compiled CPU program's padded exchange are default tests);
# the second case adds the dense dispatch's row (its FLOPs above the sparse one's), 45 s more
@pytest.mark.full_grid
@pytest.mark.covered_by(
    "tests/distributed/test_parity_compile.py::test_compile_only_target[tpu:v5p-16-layouts0]",
    "tests/unit/tools/test_parity_compile.py::"
    "test_program_summary_counts_collectives_padded_exchange_and_kernels",
    "tests/unit/tools/test_parity_compile.py::test_expected_exchange_follows_the_platform",
    "tests/distributed/test_ep.py::"
    "test_remat_replays_the_dispatch_but_not_the_expert_ffn_and_return",
)
@pytest.mark.parametrize("layouts", [["sparse-ep8"], ["sparse-ep8", "dense-ep8"]])
def test_compile_only_cpu(layouts, tmp_path, capsys):
    """XLA:CPU: the padded exchange (it has no ragged all-to-all) and the dense dispatch."""
    rc, report = compile_only(tmp_path, *TINY, "--layouts", ",".join(layouts))
    assert rc == 0 and report["ok"] and report["platform"] == "cpu" and report["devices"] == 8
    rows = {r["layout"]: r for r in report["rows"]}
    assert list(rows) == ["sparse-padded-ep8", "dense-ep8"][: len(layouts)]
    for row in rows.values():
        check_row(row)
    assert rows["sparse-padded-ep8"]["a2a"] == "padded"
    if "dense-ep8" in rows:
        assert rows["dense-ep8"]["a2a"] == "-"
        assert rows["dense-ep8"]["flops_ratio"] > rows["sparse-padded-ep8"]["flops_ratio"]
    out = capsys.readouterr().out
    assert "| sparse-padded-ep8 | yes |" in out and "| padded |" in out


def test_compile_only_refused_layout_fails(tmp_path, capsys):
    """A layout the config checks refuse (16 expert shards on 8 devices) costs no compile and
    fails the exit status."""
    rc, report = compile_only(tmp_path, *TINY, "--layouts", "sparse-ring-ep16")
    assert rc == 1 and not report["ok"] and report["rows"] == []
    assert [r["layout"] for r in report["refused"]] == ["sparse-ring-ep16"]
    assert "FAILED" in capsys.readouterr().err


def needs_compiler(target: str) -> str:
    platform = target.split(":")[0]
    if not compiler_available(platform):
        pytest.skip(f"no {platform.upper()} compiler (expertax[{platform}])")
    return platform


_TPU_DEFAULT = (
    "tests/distributed/test_parity_compile.py::test_compile_only_target[tpu:v5p-16-layouts0]"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "target,layouts",
    # the ring and the GPU (100 s for both layouts) on demand, covered by the TPU's default case
    # (the ring's program holds no target-specific exchange) and, for the GPU, by the planner's
    # compile of EP4 x FSDP2 with `auto` (ragged) and its backend choice on a GPU mesh; the whole
    # matrix of each target: -m compile_matrix (test_parity_compile_matrix*.py)
    [
        ("tpu:v5p-16", ["sparse-ep8"]),
        pytest.param(
            "tpu:v5p-16",
            list(REPRESENTATIVE),
            marks=[pytest.mark.full_grid, pytest.mark.covered_by(_TPU_DEFAULT)],
        ),
        pytest.param(
            "gpu:h100x8",
            list(REPRESENTATIVE),
            marks=[
                pytest.mark.full_grid,
                pytest.mark.covered_by(
                    _TPU_DEFAULT,
                    "tests/unit/planner/test_targets.py::"
                    "test_grouped_matmul_costs_the_routed_rows_not_all_experts"
                    "[gpu:h100x8-deepseek3-tiny-mesh0]",
                    "tests/unit/planner/test_targets.py::"
                    "test_backend_decisions_follow_the_mesh_not_the_default_backend",
                ),
            ],
        ),
    ],
)
def test_compile_only_target(target, layouts, tmp_path, capsys):
    """Through the CLI for a TPU slice and for 8 H100s, from this CPU machine: `a2a_impl=auto`
    is the native ragged all-to-all, and no padded exchange is in the program."""
    platform = needs_compiler(target)
    args = ("--target", target, *TINY, "--layouts", ",".join(layouts))
    rc, report = compile_only(tmp_path, *args)
    assert rc == 0 and report["ok"], report
    assert report["platform"] == platform and report["devices"] == 8
    rows = {r["layout"]: r for r in report["rows"]}
    want = {n.replace("sparse-ep", "sparse-ragged-ep"): REPRESENTATIVE[n] for n in layouts}
    assert list(rows) == list(want)
    for row in rows.values():
        check_row(row)
    assert [rows[n]["a2a"] for n in rows] == list(want.values())
    assert f"{target}:" in capsys.readouterr().out


# 40-75 s each on 2 cores; CI's extended run (no other test compiles a pipeline for an
# accelerator, nor pipeline.py's GPU-only select)
@pytest.mark.extended
@pytest.mark.parametrize("target", ["tpu:v5p-16", "gpu:h100x8"])
def test_compile_only_pipeline(target, tmp_path, capsys):
    """A pipelined all-to-all layout: the ragged exchange inside the stages. (XLA:GPU refused the
    scatter a stage's vmapped buffer write became with the stage axis partitioned, "Bounds of
    the window dimensions of updates must not exceed ..."; on GPU the write is a select.)"""
    needs_compiler(target)
    rc, report = compile_only(tmp_path, "--target", target, *TINY, "--layouts", PIPELINE)
    (row,) = report["rows"]
    assert rc == 0 and report["ok"], row
    check_row(row)
    assert row["a2a"] == "ragged" and row["collectives"]["collective-permute"] > 0
