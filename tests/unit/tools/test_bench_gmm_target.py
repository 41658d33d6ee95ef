"""`expertax bench gmm --target`: one tiny grid compiled for 8 H100s (nothing runs)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from expertax import cli, targets

pytestmark = pytest.mark.skipif(
    not targets.compiler_available("gpu") or importlib.util.find_spec("tokamax") is None,
    reason="the GPU compiler or tokamax (expertax[gpu]) is missing",
)
KEYS = {
    "backend",
    "impl",
    "pass",
    "rows",
    "experts",
    "compiled_flops",
    "worst_flops",
    "routed_flops",
    "temp_bytes",
    "out_bytes",
    "kernel",
}


def test_target_rows_and_the_markdown_from_json(tmp_path, capsys):
    """16 experts of 64 rows, [1024, 256] x [16, 256, 512]: XLA:GPU's ragged_dot is a dense
    matmul over all 16 experts (16x the routed FLOPs: the negative control), tokamax's Triton
    kernel computes 64-row blocks, its row block capped at the rows per expert (1x at balanced
    routing; the worst case for the buffer adds one block per group boundary)."""
    path, md = tmp_path / "t.json", tmp_path / "t.md"
    grid = ["--experts", "16", "--rows-per-expert", "64", "--shape", "256x512", "--passes", "fwd"]
    backends = ["--backends", "tokamax_triton,ragged_dot"]
    rc = cli.main(["bench", "gmm", "--target", "gpu:h100x8", *grid, *backends, "--json", str(path)])
    assert rc == 0
    rows = {r["impl"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"tokamax_triton", "ragged_dot"}
    for r in rows.values():
        assert KEYS <= set(r) and r["rows"] == 1024 and r["pass"] == "fwd"
        assert r["routed_flops"] == 2 * 1024 * 256 * 512
    assert rows["ragged_dot"]["flops_ratio"] == 16.0 and "dot" in rows["ragged_dot"]["kernel"]
    triton = rows["tokamax_triton"]
    assert triton["flops_ratio"] == 1.0 and triton["kernel"] == "tokamax:triton gmm (row block 64)"
    assert triton["worst_flops"] == 2 * (16 + 15) * 64 * 256 * 512  # ceil(M/b) + G - 1 blocks
    assert triton["temp_bytes"] < 1024 * 512 * 2  # under the output's size
    capsys.readouterr()
    assert (
        cli.main(
            [
                "bench",
                "gmm",
                "--target",
                "gpu:h100x8",
                "--from-json",
                str(path),
                "--markdown",
                str(md),
            ]
        )
        == 0
    )
    table = md.read_text()
    assert "| gpu:h100x8 | ragged_dot | fwd | 16 | 64 | 1024 | 16.000 |" in table
    assert "compiled (not run)" in table and "load average" in table
