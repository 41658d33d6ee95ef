"""No module of the package or the benchmarks runs over 500 lines: one that does holds more than
one job, and is split where its jobs part (one module each), not trimmed to fit."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 500


def _lines(path: Path) -> int:
    with path.open(encoding="utf-8") as f:
        return sum(1 for _ in f)


def oversized(root: Path = ROOT, folders=("src", "benchmarks")) -> list[tuple[str, int]]:
    """(path from `root`, lines) of every .py file under `folders` over MAX_LINES, longest
    first."""
    found = [
        (path.relative_to(root).as_posix(), _lines(path))
        for folder in folders
        for path in sorted((root / folder).rglob("*.py"))
    ]
    return sorted(((p, n) for p, n in found if n > MAX_LINES), key=lambda x: -x[1])


def test_no_module_over_500_lines():
    over = oversized()
    listed = "\n".join(f"  {path}: {n} lines" for path, n in over)
    assert not over, f"{len(over)} module(s) over {MAX_LINES} lines; split each by job:\n{listed}"


def test_the_count_sees_a_long_module(tmp_path):
    """Negative control: a file one line over the limit is listed, one at the limit is not."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "src" / "ok.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "src" / "notes.txt").write_text("x\n" * (2 * MAX_LINES))  # not Python
    assert oversized(tmp_path, ("src",)) == [("src/long.py", MAX_LINES + 1)]
