"""from-hf's and to-hf's own (anonymous) memory does not grow with the checkpoint (issue 16)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "convert.py"


@pytest.mark.extended
def test_peak_anonymous_memory_does_not_grow_with_the_checkpoint(tmp_path):
    spec = importlib.util.spec_from_file_location("convert_bench", _BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    peaks = {}
    for gib in (0.8, 1.3):  # 1 and 2 Mixtral-shaped layers of 550 MB (experts of 23 MB)
        base = tmp_path / f"{gib}"
        nbytes = bench.make_checkpoint(base / "hf", gib)
        one = bench.measure("from-hf", base / "hf", base / "ours")
        two = bench.measure("to-hf", base / "ours", base / "back")
        peaks[gib] = (nbytes, one["peak_anon_bytes"], two["peak_anon_bytes"])
    (small, a1, b1), (large, a2, b2) = peaks[0.8], peaks[1.3]
    assert large > 1.5 * small
    # the interpreter, jax and numpy take ~0.4 GiB; a few 23-130 MB units come on top
    assert max(a1, a2, b1, b2) < 2**30, peaks
    assert a2 < a1 + 64 * 2**20 and b2 < b1 + 64 * 2**20, peaks  # model grew by 550 MB
