"""Context parallelism in `expertax parity` for mixtral-tiny (GQA, no MTP): the default matrix's
three layouts that deepseek3-tiny's default rows do not cover (test_parity_context.py), on packed
data, one with the load-balanced reorder off. Together the two files run all five layouts the
default context matrix names in CI. A file of its own: xdist (`--dist loadfile`) gives it a
worker of its own."""

from __future__ import annotations

import pytest

from tests.distributed.test_parity_context import _context_table

pytestmark = pytest.mark.distributed

DEFAULT_ROWS = ["sparse-ring-cp4-ep2", "dense-cp8", "sparse-padded-cp2-ep2-tp2-nolb"]


@pytest.mark.extended  # a parity table in a CLI child (20-70 s): CI's second run
def test_context_rows_mixtral_tiny(tmp_path):
    rows = _context_table(["model_name=mixtral-tiny"], DEFAULT_ROWS, tmp_path)
    assert [r["load_balance"] for r in rows] == [True, True, False]
