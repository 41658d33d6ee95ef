"""`expertax parity --compile-only` over the whole default matrix, compiled without the hardware
(29 compiles of 10-45 s each, 12-20 minutes per model and target on 2 cores: more than CI's
budget holds, so these are marked `compile_matrix` and run on demand,
`python -m pytest -m compile_matrix`). deepseek3-tiny's matrix for a TPU v5p slice here,
mixtral-tiny's for 8 H100s in test_parity_compile_matrix_gpu.py (a file each, for two xdist
workers). The default run compiles representative layouts on both targets
(test_parity_compile.py); the tables of every layout are in docs/design/parity.md."""

from __future__ import annotations

import pytest

from tests.distributed.test_parity_compile import check_row, compile_only, needs_compiler

pytestmark = pytest.mark.distributed


@pytest.mark.compile_matrix
@pytest.mark.covered_by(
    # one layout of each path compiled for the targets: the sparse exchanges (TPU), the
    # pipelined all-to-all layout (both), the whole step's grouped matmuls (GPU, TPU); each
    # layout kind of the matrix trained on 8 CPU devices (the extended parity sample)
    "tests/distributed/test_parity_compile.py::test_compile_only_target[tpu:v5p-16-layouts0]",
    "tests/distributed/test_parity_compile.py::test_compile_only_pipeline[tpu:v5p-16]",
    "tests/unit/planner/test_targets.py::test_grouped_matmul_costs_the_routed_rows_not_all_experts[tpu:v5p-16-mixtral-tiny-mesh4]",
    "tests/distributed/test_parity_matrix.py::test_parity_matrix_sample",
)
def test_compile_only_full_matrix_deepseek3_on_tpu(tmp_path):
    check_full_matrix("deepseek3-tiny", "tpu:v5p-16", tmp_path)


def check_full_matrix(model, target, tmp_path):
    """Every default layout compiles (33 on a platform with both exchanges, less the 4 pipelines
    the models' 2 pipelined layers do not divide into: 4 stages; 2 stages x 2 repeats); every
    all-to-all layout holds the exchange it asks for (`auto`: the ragged all-to-all), no padded
    exchange where it asks for the ragged one."""
    platform = needs_compiler(target)
    rc, report = compile_only(
        tmp_path, "--target", target, f"model_name={model}", "max_target_length=32"
    )
    assert report["refused"] == [] and len(report["skipped"]) == 4
    assert len(report["rows"]) == 29
    compiled = [r for r in report["rows"] if r["status"] == "yes"]
    failed = [r for r in report["rows"] if r["status"] != "yes"]
    assert rc == 0 and report["ok"] and failed == [], failed
    for row in compiled:
        check_row(row)
    exchanges = {r["layout"]: r["a2a"] for r in compiled if r["a2a"] != "-"}
    assert {n for n, a in exchanges.items() if a == "ragged"} == {
        n for n in exchanges if "-ragged-" in n
    }
    # ragged and padded on the 7 meshes with expert shards, the pipelined one included
    assert len(exchanges) == 14, (platform, exchanges)
