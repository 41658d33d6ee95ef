"""The test run's time: a durations report at the end of every run, units scheduled longest
first, and the cheaper code generation for every test that compares within a tolerance (a
pytest plugin, registered by tests/conftest.py).

The report (in the controller, after the summary): the 30 slowest tests (setup, call and
teardown together) and the seconds spent per test folder, so that a regression shows in CI's log.
With `EXPERTAX_DURATIONS_OUT=PATH` the run also writes every test's seconds to PATH as JSON.

The code generation: in the default run with two workers or more, worker gw0 compiles with
XLA:CPU's default (`CHEAP_CPU_CODEGEN`, tests/xla_flags.py) and every other worker with
`TOLERANCE_ONLY_CODEGEN` (its direct LLVM IR emitters instead of the MLIR fusion pipeline: a
train step of the tiny models compiles in about 0.65 x the time). The cheaper one changes
fusions and the rounding of some of them, so a test that compares two programs bitwise or reads
the compiled program's fusions is marked `default_codegen` and runs on gw0; every other test may
run on either. `-n auto` starts one worker more than the machine has cores (at most
`--maxprocesses`): gw0 takes the `default_codegen` tests and stops when none is left, the others
take the rest; with two workers (`-n 2`) gw0 takes the rest too, once its own tests are done.
`-n 0` and `-n 1` run everything on the default.

The schedule: pytest-xdist gives each worker a whole unit at a time (`--dist loadfile`: a unit is
a file's tests, which share their module fixtures and compiled programs, or, apart, its
`default_codegen` tests); `tests/durations.json` holds each unit's measured seconds (from a whole
run, `EXPERTAX_DURATIONS_OUT`), and the units are handed out in decreasing order of it, the
longest-processing-time rule, so that no long unit starts last and leaves one worker running
alone. A unit the table does not know is taken for the median unit's time. The order changes
only which worker runs what, never what runs. The controller schedules before any worker has
collected a test, so it finds the `default_codegen` tests by reading the test files' decorators
(`default_codegen_tests`); tests/unit/test_on_demand.py checks that this finds exactly the tests
the marker is on."""

from __future__ import annotations

import ast
import collections
import functools
import json
import os
import statistics
from pathlib import Path

import pytest

TABLE = Path(__file__).with_name("durations.json")
ROOT = Path(__file__).parents[1]
SLOWEST = 30
MARKER = "default_codegen"
_APART = f"::{MARKER}"  # the scope of a file's default_codegen tests


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# The default run's marker expression (pyproject.toml's addopts); the split of the code
# generation holds only in a run that selects with it
DEFAULT_MARKEXPR = "not extended and not compile_matrix and not full_matrix and not full_grid"
SPLIT = "EXPERTAX_TEST_CODEGEN_SPLIT"  # set by the controller for its workers


@functools.cache
def _table() -> dict:
    """tests/durations.json, read once per process (the scheduler asks at every hand-out)."""
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def unit_seconds(markexpr: str = DEFAULT_MARKEXPR) -> dict[str, float]:
    """The measured seconds per unit (tests/durations.json) in the default run, or per file in
    the extended one for `-m extended`; {} without the table."""
    return _table().get("extended" if markexpr == "extended" else "units", {})


def _is_marker(node: ast.expr) -> bool:
    """`@pytest.mark.default_codegen`, with or without a call."""
    node = node.func if isinstance(node, ast.Call) else node
    return isinstance(node, ast.Attribute) and node.attr == MARKER


@functools.cache
def default_codegen_tests(root: Path = ROOT) -> frozenset[str]:
    """`file::function` of every test function under root/tests decorated with
    `@pytest.mark.default_codegen` (read from the source: the controller has no collection)."""
    found = set()
    for path in sorted((root / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(map(_is_marker, node.decorator_list)):
                found.add(f"{path.relative_to(root).as_posix()}::{node.name}")
    return frozenset(found)


def scope_of(nodeid: str) -> str:
    """The scheduling unit of a test: its file, or its file's `default_codegen` tests."""
    file = _file_of(nodeid)
    function = nodeid.split("::")[-1].split("[", 1)[0]
    return file + _APART if f"{file}::{function}" in default_codegen_tests() else file


def worker_codegen(worker: str | None, workers: int) -> str:
    """The code generation of xdist worker `worker` ("gw3"; None outside xdist) of `workers`:
    "default" on gw0 and "cheap" on the others when there are two or more and the controller
    split the run (`SPLIT`), else "default"."""
    if worker is None or workers < 2 or os.environ.get(SPLIT) != "1":
        return "default"
    return "cheap" if int(worker.removeprefix("gw")) else "default"


def auto_workers(config) -> int | None:
    """`-n auto` in a split run: one worker more than the cores, for gw0's `default_codegen`
    tests (it stops when they are done); None elsewhere (pytest-xdist's own count)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    if config.getoption("markexpr", "") != DEFAULT_MARKEXPR:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cores or 1) + 1


def _make_scheduler_class():
    from xdist.scheduler import LoadFileScheduling

    class CodegenScheduling(LoadFileScheduling):
        """`--dist loadfile` over the units (`scope_of`) in the table's order. In a split run
        gw0 takes the `default_codegen` units first, then stops if two workers or more are left
        for the rest or else takes the rest too; the others take only the rest and stop when
        none is left."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            # the workers started (as each worker counts them), not those still running
            self.workers = len(config.getvalue("tx") or ())

        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _assign_work_unit(self, node):
            if os.environ.get(SPLIT) == "1" and self.workers >= 2:
                apart = [s for s in self.workqueue if s.endswith(_APART)]
                rest = [s for s in self.workqueue if not s.endswith(_APART)]
                if worker_codegen(node.gateway.id, self.workers) == "cheap":
                    scope = rest[0] if rest else None
                elif apart:
                    scope = apart[0]
                else:
                    scope = rest[0] if rest and self.workers == 2 else None
                if scope is None:
                    node.shutdown()
                    return
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return CodegenScheduling


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    return _make_scheduler_class()(config, log)


def pytest_collection_modifyitems(session, config, items):
    """Units in decreasing order of their measured seconds, each unit's tests in their order."""
    markexpr = config.getoption("markexpr", "")
    known = unit_seconds(markexpr)
    if not known:
        return
    unit = scope_of if markexpr != "extended" else _file_of
    default = statistics.median(known.values())
    first_index: dict[str, int] = {}
    for i, item in enumerate(items):
        first_index.setdefault(unit(item.nodeid), i)
    items.sort(key=lambda it: (-known.get(unit(it.nodeid), default), first_index[unit(it.nodeid)]))


class Durations:
    """Seconds per test, summed over its setup, call and teardown reports."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] += report.duration

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter):
        if not self.seconds:
            return
        write = terminalreporter.write_line
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        terminalreporter.section(f"the {SLOWEST} slowest tests (setup + call + teardown)")
        for nodeid, s in ranked[:SLOWEST]:
            write(f"{s:8.1f} s  {nodeid}")
        folders: dict[str, float] = collections.defaultdict(float)
        for nodeid, s in self.seconds.items():
            folders[str(Path(_file_of(nodeid)).parent)] += s
        terminalreporter.section("seconds per test folder (summed over the workers)")
        for folder, s in sorted(folders.items(), key=lambda kv: -kv[1]):
            write(f"{s:8.1f} s  {folder}")
        write(f"{sum(self.seconds.values()):8.1f} s  in all, {len(self.seconds)} tests")
        out = os.environ.get("EXPERTAX_DURATIONS_OUT")
        if out:
            Path(out).write_text(json.dumps(dict(ranked), indent=0) + "\n")


def pytest_configure(config):
    # the report and the split live in the controller (or the only process): xdist's workers
    # send it their reports, and inherit its environment when it starts them; a worker has
    # `workerinput`
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(Durations(), "expertax-durations")
        split = config.getoption("markexpr", "") == DEFAULT_MARKEXPR
        os.environ[SPLIT] = "1" if split else "0"


def _per_unit(per_test: dict[str, float], unit) -> dict[str, float]:
    units: dict[str, float] = collections.defaultdict(float)
    for nodeid, s in per_test.items():
        units[unit(nodeid)] += s
    return dict(sorted(((f, round(s, 1)) for f, s in units.items()), key=lambda kv: -kv[1]))


def write_table(default: dict[str, float], extended: dict[str, float], note: str) -> None:
    """tests/durations.json from the per-test seconds (`EXPERTAX_DURATIONS_OUT`) of a default
    and an extended run: the seconds per unit of the one and per file of the other, rounded to
    0.1 s."""
    table = {
        "measured": note,
        "units": _per_unit(default, scope_of),
        "extended": _per_unit(extended, _file_of),
    }
    TABLE.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":  # python -m tests.timing DEFAULT.json EXTENDED.json "how measured"
    import sys

    runs = [json.loads(Path(p).read_text()) for p in sys.argv[1:3]]
    write_table(*runs, sys.argv[3])
