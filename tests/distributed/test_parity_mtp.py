"""`expertax parity` with multi-token prediction on (models/mtp.py): one device against expert
parallelism (all-to-all and ring), FSDP, a pipeline (MTP after the last stage) and the paged
stash, on the objective's cross-entropy (the main loss + lambda x the MTP loss,
tools/parity/run.py). On demand (-m full_grid): the default run's deepseek context rows train MTP on
the all-to-all beside FSDP and on a ring pipeline (MTP after the last stage)."""

from __future__ import annotations

import json

import pytest

from tests.distributed.test_parity import _check_rows, parity_child

pytestmark = pytest.mark.distributed

# all-to-all with FSDP, and a ring pipeline (MTP after the last stage); EP8 ring and the stash
# passed too (2026-11-26), left out for CI's budget
LAYOUTS = ["sparse-ep4-fsdp2", "sparse-ring-pp2-ep2-fsdp2"]


@pytest.mark.full_grid  # on demand: ~90 s on 2 cores
@pytest.mark.covered_by(
    "tests/distributed/test_parity_context.py::test_context_rows_deepseek3_tiny_with_mtp",
    "tests/unit/models/test_mtp.py::test_mtp_loss_and_gradients_equal_the_oracle"
    "[deepseek3-tiny-2-True-over1]",
)
def test_parity_with_mtp(tmp_path):
    """In a child with the tolerance-only code generation (`parity_child`)."""
    path = tmp_path / "parity.json"
    args = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "max_target_length=32"]
    run = parity_child([*args, "--steps", "3", "--layouts", ",".join(LAYOUTS)], path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(path.read_text())
    _check_rows(report["rows"], report["tolerance"], 10.0, len(LAYOUTS))
    staged = [r for r in report["rows"] if r["pp"] == 2]
    assert len(staged) == 1
    assert "| sparse | True | - | 2 | 2 | 2 | 1 | 1 | no | default |" in run.stdout
