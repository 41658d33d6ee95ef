"""`expertax parity` over the layout matrix: a sample of it for deepseek3-tiny in the extended
run (CI runs it after the default run), the whole matrix of both tiny models on demand
(-m full_matrix; 400-450 s each on 2 cores), covered in CI by the sample and the tests that
`COVERED` names. A file of its own so that pytest-xdist (a file per worker) runs it beside the
other parity tests rather than after them."""

from __future__ import annotations

import json

import pytest

from tests.distributed.test_parity import _check_rows, parity_child

pytestmark = pytest.mark.distributed

COVERED = pytest.mark.covered_by(
    # each layout kind trained (the sample), pipelined (ring, all-to-all), with
    # the paged stash (bitwise), under context parallelism
    "tests/distributed/test_parity_matrix.py::test_parity_matrix_sample",
    "tests/distributed/test_parity.py::test_parity_pipeline_with_negative_control",
    "tests/distributed/test_pipeline.py::test_pipeline_trains_like_no_pipeline[mixtral-pp2-ep2-fsdp2]",
    "tests/distributed/test_stash.py::test_stash_gradients_bitwise_under_expert_parallelism[mixtral-tiny-a2a-ep4-fsdp2-balanced]",
    "tests/distributed/test_parity_context_mixtral.py::test_context_rows_mixtral_tiny",
)


@pytest.mark.parametrize(
    "model,extra",
    [
        pytest.param("deepseek3-tiny", [], marks=[pytest.mark.full_matrix, COVERED]),
        pytest.param("mixtral-tiny", [], marks=[pytest.mark.full_matrix, COVERED]),
    ],
)
def test_parity_full_matrix(model, extra, tmp_path):
    """3 steps of the whole layout matrix (the deep-model tests, test_parity_deep.py, train
    longer and deeper) (24 layouts on 8 devices, 2 with the paged stash, 4 with
    expert-as-TP rules, 6 pipelined); on demand. Both models have 2
    pipelined (MoE) layers: the 3 two-stage pipelines run, the 4-stage and circular ones are
    skipped (deepseek3-tiny keeps its 3 layers so that its dense layer runs outside the
    pipeline). The CLI runs in a child with the tolerance-only code generation
    (tests/xla_flags.py: the losses are compared within tolerance, and each layout's compile
    takes about 0.6 x the time). Its output also holds XLA's own (C++) warnings: no layout's
    compile may fall back to replicating a tensor ("involuntary full rematerialization", which
    the embedding lookup caused at ep2-tp2-data2 before its table was gathered over
    `embed`)."""
    path = tmp_path / "parity.json"
    run = parity_child(
        [f"model_name={model}", *extra, "max_target_length=32", "--steps", "3"], path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    printed, err = run.stdout, run.stderr
    assert "Involuntary full rematerialization" not in printed + err
    assert "| sparse | False | padded | 1 | 8 | 1 | 1 | 1 | no | default |" in printed
    assert "| sparse | True | - | 1 | 2 | 2 | 2 | 1 | no | ep-tp |" in printed
    assert "| sparse | False | padded | 1 | 4 | 2 | 1 | 1 | yes | default |" in printed
    report = json.loads(path.read_text())
    _check_rows(report["rows"], report["tolerance"], 10.0, 21)
    assert len(report["skipped"]) == 3 and report["refused"] == []
    staged = {(r["mode"], r["ring"], r["pp"], r["ep"], r["fsdp"]) for r in report["rows"]}
    assert {("sparse", True, 2, 2, 2), ("dense", False, 2, 1, 4)} <= staged
    layouts = {
        (r["mode"], r["ring"], r["ep"], r["fsdp"], r["tp"], r["data"], r["stash"])
        for r in report["rows"]
    }
    assert ("sparse", True, 4, 2, 1, 1, False) in layouts
    assert ("dense", False, 2, 1, 2, 2, False) in layouts
    assert {("sparse", True, 4, 2, 1, 1, True), ("sparse", False, 4, 2, 1, 1, True)} <= layouts
    eptp = {
        (r["ring"], r["ep"], r["fsdp"], r["tp"], r["data"])
        for r in report["rows"]
        if r["sharding_rules"] == "ep-tp"
    }
    assert eptp == {(ring, 2, f, 2, d) for ring in (False, True) for f, d in ((2, 1), (1, 2))}


# One layout of each kind the matrix holds, on deepseek3-tiny (its dense first layer, shared
# expert and sigmoid routing): the native ring of experts, the padded exchange under expert x
# tensor x data (where the embedding lookup once replicated its table), the dense dispatch and
# the expert axis as tensor parallelism (ep-tp rules). Pipelines: the default run's
# test_parity_pipeline_with_negative_control and test_pipeline.py; the paged stash: the default
# run's bitwise tests (tests/unit/nn/moe/test_stash.py, tests/distributed/test_stash.py), its
# parity row on demand (CI's budget).
SAMPLE = (
    "sparse-ring-ep8",
    "sparse-padded-ep2-tp2-data2",
    "dense-ep4-fsdp2",
    "sparse-ring-ep2-fsdp2-tp2-eptp",
)


@pytest.mark.extended
def test_parity_matrix_sample(tmp_path):
    """3 steps of four layouts of the matrix, one of each kind, against the one-device run."""
    path = tmp_path / "parity.json"
    argv = ["model_name=deepseek3-tiny", "max_target_length=32", "--steps", "3"]
    run = parity_child([*argv, "--layouts", ",".join(SAMPLE)], path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Involuntary full rematerialization" not in run.stdout + run.stderr
    report = json.loads(path.read_text())
    _check_rows(report["rows"], report["tolerance"], 10.0, len(SAMPLE))
    got = {
        (
            r["mode"],
            r["ep"],
            r["fsdp"],
            r["tp"],
            r["data"],
            r["pp"],
            r["stash"],
            r["sharding_rules"],
        )
        for r in report["rows"]
    }
    assert got == {
        ("sparse", 8, 1, 1, 1, 1, False, "default"),
        ("sparse", 2, 1, 2, 2, 1, False, "default"),
        ("dense", 4, 2, 1, 1, 1, False, "default"),
        ("sparse", 2, 2, 2, 1, 1, False, "ep-tp"),
    }
