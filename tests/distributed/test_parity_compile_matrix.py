"""`expertax parity --compile-only` over the whole default matrix, compiled without the hardware
(extended: 29 compiles of 10-45 s each). CI compiles deepseek3-tiny's matrix for a TPU v5p slice
here and mixtral-tiny's for 8 H100s in test_parity_compile_matrix_gpu.py (a file each, so that
pytest-xdist runs them on two workers): every layout of the matrix meets both compilers, each
model one of them, within CI's budget. The other two pairs compile too (BENCHMARKS.md, parity
--compile-only tables); the default run compiles representative layouts of both models on
both targets (test_parity_compile.py)."""

from __future__ import annotations

import pytest

from tests.distributed.test_parity_compile import check_row, compile_only, needs_compiler

pytestmark = pytest.mark.distributed


@pytest.mark.extended
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
