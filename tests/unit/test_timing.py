"""The test run's schedule (tests/timing.py): units longest first, the default code generation
on gw0 of a split default run for the tests marked `default_codegen`, the cheaper one on the
other workers for the rest."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests import timing


def test_only_gw0_of_a_split_run_keeps_the_default_code_generation(monkeypatch):
    monkeypatch.setenv(timing.SPLIT, "1")
    assert [timing.worker_codegen(f"gw{i}", 4) for i in range(4)] == [
        "default",
        "cheap",
        "cheap",
        "cheap",
    ]
    assert timing.worker_codegen(None, 1) == "default"  # -n 0
    assert timing.worker_codegen("gw0", 1) == "default"  # -n 1
    monkeypatch.setenv(timing.SPLIT, "0")  # another marker expression: no split
    assert timing.worker_codegen("gw1", 2) == "default"


def test_auto_starts_one_worker_more_than_the_cores_in_the_default_run_only(monkeypatch):
    import os

    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    default = SimpleNamespace(getoption=lambda name, d=None: timing.DEFAULT_MARKEXPR)
    extended = SimpleNamespace(getoption=lambda name, d=None: "extended")
    assert timing.auto_workers(default) == len(os.sched_getaffinity(0)) + 1
    assert timing.auto_workers(extended) is None
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")  # the user's count wins
    assert timing.auto_workers(default) is None


def test_marked_tests_are_found_in_the_source_and_form_their_own_unit(tmp_path):
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    (tmp_path / "tests" / "sub" / "test_x.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.default_codegen\n@pytest.mark.parametrize('a', [1])\ndef test_a(a): pass\n\n"
        "@pytest.mark.slow\ndef test_b(): pass\n"
    )
    assert timing.default_codegen_tests(tmp_path) == {"tests/sub/test_x.py::test_a"}
    assert timing.scope_of("tests/unit/nn/moe/test_stash.py::test_pages_round_trip") == (
        "tests/unit/nn/moe/test_stash.py"
    )
    marked = "tests/unit/nn/moe/test_stash.py::test_stash_gradients_are_bitwise_the_plain_stacks"
    assert timing.scope_of(f"{marked}[mixtral-tiny]") == (
        "tests/unit/nn/moe/test_stash.py::default_codegen"
    )


def test_the_default_marker_expression_is_pyprojects():
    import tomllib
    from pathlib import Path

    ini = tomllib.loads(Path(timing.__file__).parents[1].joinpath("pyproject.toml").read_text())
    assert f"-m '{timing.DEFAULT_MARKEXPR}'" in ini["tool"]["pytest"]["ini_options"]["addopts"]


def test_every_unit_in_the_table_is_a_file_or_its_marked_tests():
    table = json.loads(timing.TABLE.read_text())
    assert table["units"] and table["extended"]
    for unit in table["units"]:
        file = unit.removesuffix("::default_codegen")
        assert (timing.ROOT / file).is_file(), unit
        if unit != file:
            assert any(t.startswith(f"{file}::") for t in timing.default_codegen_tests()), unit


class _Node:
    def __init__(self, worker):
        self.gateway = SimpleNamespace(id=worker)
        self.sent, self.down = [], False

    def send_runtest_some(self, indexes):
        self.sent.append(indexes)

    def shutdown(self):
        self.down = True


def _scheduler(monkeypatch, workers, units):
    pytest.importorskip("xdist")
    monkeypatch.setenv(timing.SPLIT, "1")
    config = SimpleNamespace(getvalue=lambda name: ["popen"] * workers, option=SimpleNamespace())
    sched = timing._make_scheduler_class()(config)
    nodes = [_Node(f"gw{i}") for i in range(workers)]
    ids = [f"{u}::t" for u in [*units, "f.py"]]
    for node in nodes:
        sched.registered_collections[node] = ids
        sched.assigned_work[node] = {}
    for u in units:  # the queue in the table's order
        sched.workqueue[u] = {f"{u}::t": False}
    return sched, nodes


APART = ["a.py", "b.py::default_codegen", "c.py", "d.py::default_codegen", "e.py"]


def test_gw0_takes_the_marked_units_then_stops_when_two_workers_take_the_rest(monkeypatch):
    sched, (gw0, gw1, gw2) = _scheduler(monkeypatch, 3, APART)
    sched._assign_work_unit(gw1)  # cheap: the first unit not marked
    sched._assign_work_unit(gw0)  # default: the first marked unit
    sched._assign_work_unit(gw2)
    sched._assign_work_unit(gw0)  # then the next marked one
    sched._assign_work_unit(gw1)
    assert [list(sched.assigned_work[n]) for n in (gw0, gw1, gw2)] == [
        ["b.py::default_codegen", "d.py::default_codegen"],
        ["a.py", "e.py"],
        ["c.py"],
    ]
    sched._assign_work_unit(gw0)  # none marked is left: gw0 stops, the others do the rest
    assert gw0.down and not gw1.down
    sched.workqueue["f.py"] = {"f.py::t": False}
    sched._assign_work_unit(gw2)
    assert list(sched.assigned_work[gw2]) == ["c.py", "f.py"]
    sched._assign_work_unit(gw1)  # nothing is left for a cheap worker: it stops
    assert gw1.down


def test_with_two_workers_gw0_takes_the_rest_once_its_marked_units_are_done(monkeypatch):
    sched, (gw0, gw1) = _scheduler(monkeypatch, 2, APART)
    for node in (gw0, gw1, gw0, gw0, gw1):
        sched._assign_work_unit(node)
    assert [list(sched.assigned_work[n]) for n in (gw0, gw1)] == [
        ["b.py::default_codegen", "d.py::default_codegen", "c.py"],
        ["a.py", "e.py"],
    ]
    assert not gw0.down and not gw1.down and not sched.workqueue
