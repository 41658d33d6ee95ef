"""The test run's schedule (tests/timing.py): files longest first, the cheaper code generation
only on the odd-numbered workers of a split default run, and only for the files listed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests import timing


def test_only_odd_workers_of_a_split_run_take_the_cheaper_code_generation(monkeypatch):
    monkeypatch.setenv(timing.SPLIT, "1")
    assert [timing.worker_codegen(f"gw{i}", 4) for i in range(4)] == [
        "default",
        "cheap",
        "default",
        "cheap",
    ]
    assert timing.worker_codegen(None, 1) == "default"  # -n 0
    assert timing.worker_codegen("gw0", 1) == "default"  # -n 1
    monkeypatch.setenv(timing.SPLIT, "0")  # another marker expression: no split
    assert timing.worker_codegen("gw1", 2) == "default"


def test_the_default_marker_expression_is_pyprojects():
    import tomllib
    from pathlib import Path

    ini = tomllib.loads(Path(timing.__file__).parents[1].joinpath("pyproject.toml").read_text())
    assert f"-m '{timing.DEFAULT_MARKEXPR}'" in ini["tool"]["pytest"]["ini_options"]["addopts"]


def test_every_listed_file_exists_and_the_table_is_whole():
    from pathlib import Path

    root = Path(timing.__file__).parents[1]
    table = json.loads(timing.TABLE.read_text())
    assert table["files"] and set(table["cheap_codegen"]) <= set(table["files"])
    assert all((root / f).is_file() for f in table["cheap_codegen"])


class _Node:
    def __init__(self, worker):
        self.gateway = SimpleNamespace(id=worker)
        self.sent, self.down = [], False

    def send_runtest_some(self, indexes):
        self.sent.append(indexes)

    def shutdown(self):
        self.down = True


def test_a_cheap_worker_takes_only_listed_files_and_a_default_one_prefers_the_others(
    monkeypatch,
):
    pytest.importorskip("xdist")
    monkeypatch.setenv(timing.SPLIT, "1")
    monkeypatch.setattr(timing, "cheap_codegen_files", lambda: frozenset({"b.py", "c.py"}))
    config = SimpleNamespace(getvalue=lambda name: ["popen"] * 2, option=SimpleNamespace())
    sched = timing._make_scheduler_class()(config)
    gw0, gw1 = _Node("gw0"), _Node("gw1")
    ids = ["a.py::t", "b.py::t", "c.py::t", "d.py::t"]
    for node in (gw0, gw1):
        sched.registered_collections[node] = ids
        sched.assigned_work[node] = {}
    for f in ("a.py", "b.py", "c.py", "d.py"):  # the queue in the table's order
        sched.workqueue[f] = {f"{f}::t": False}
    sched._assign_work_unit(gw1)  # cheap: the first listed file
    sched._assign_work_unit(gw0)  # default: the first file not listed
    sched._assign_work_unit(gw0)  # then the next not listed
    sched._assign_work_unit(gw0)  # then a listed one: only those are left
    assert [list(w) for w in (sched.assigned_work[gw1], sched.assigned_work[gw0])] == [
        ["b.py"],
        ["a.py", "d.py", "c.py"],
    ]
    assert not sched.workqueue
    sched.workqueue["a2.py"] = {"a2.py::t": False}
    sched._assign_work_unit(gw1)  # nothing listed is left: the cheap worker stops
    assert gw1.down and not gw0.down
