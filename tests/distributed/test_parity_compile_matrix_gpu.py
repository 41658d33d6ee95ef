"""`expertax parity --compile-only` over mixtral-tiny's whole default matrix for 8 H100s (extended;
see test_parity_compile_matrix.py)."""

from __future__ import annotations

import pytest

from tests.distributed.test_parity_compile_matrix import check_full_matrix

pytestmark = pytest.mark.distributed


@pytest.mark.compile_matrix
def test_compile_only_full_matrix_mixtral_on_gpu(tmp_path):
    check_full_matrix("mixtral-tiny", "gpu:h100x8", tmp_path)
