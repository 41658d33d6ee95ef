"""`expertax parity --compile-only` over mixtral-tiny's whole default matrix for 8 H100s (extended;
see test_parity_compile_matrix.py)."""

from __future__ import annotations

import pytest

from tests.distributed.test_parity_compile_matrix import check_full_matrix

pytestmark = pytest.mark.distributed


@pytest.mark.compile_matrix
@pytest.mark.covered_by(
    # one layout of each path compiled for the targets: the sparse exchanges (TPU), the
    # pipelined all-to-all layout (both), the whole step's grouped matmuls (GPU, TPU); each
    # layout kind of the matrix trained on 8 CPU devices (the extended parity sample)
    "tests/distributed/test_parity_compile.py::test_compile_only_pipeline[gpu:h100x8]",
    "tests/unit/planner/test_targets.py::test_grouped_matmul_costs_the_routed_rows_not_all_experts[gpu:h100x8-deepseek3-tiny-mesh0]",
    "tests/distributed/test_parity_matrix.py::test_parity_matrix_sample",
)
def test_compile_only_full_matrix_mixtral_on_gpu(tmp_path):
    check_full_matrix("mixtral-tiny", "gpu:h100x8", tmp_path)
