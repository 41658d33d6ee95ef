"""The test run's time: a durations report at the end of every run, files scheduled longest
first, and the cheaper code generation on every other worker (a pytest plugin, registered by
tests/conftest.py).

The report (in the controller, after the summary): the 30 slowest tests (setup, call and
teardown together) and the seconds spent per test folder, so that a regression shows in CI's log.
With `EXPERTAX_DURATIONS_OUT=PATH` the run also writes every test's seconds to PATH as JSON.

The schedule: pytest-xdist gives each worker a whole file at a time (`--dist loadfile`: a file's
tests share their module fixtures and compiled programs); `tests/durations.json` holds each
file's measured seconds (from a whole run, `EXPERTAX_DURATIONS_OUT`), and the files are handed out
in decreasing order of it, the longest-processing-time rule, so that no long file starts last
and leaves one worker running alone. A file the table does not know is taken for the median
file's time. The order changes only which worker runs what, never what runs.

The code generation: with two workers or more, the odd-numbered ones (gw1, gw3, ...) compile
with `TOLERANCE_ONLY_CODEGEN` (tests/xla_flags.py: XLA:CPU's direct LLVM IR emitters instead of
its MLIR fusion pipeline), the even-numbered ones with the default (`CHEAP_CPU_CODEGEN`). The
cheaper one changes fusions and their rounding, so a file runs on it only where the table's
`cheap_codegen` lists it: a file measured to pass there, bitwise comparisons included, and to
run no more than 10 % slower (the tests that compare programs bitwise across remat policies, the
paged stash, the tiled grouped matmul, read compiled HLO for exact buffers, or run the Pallas
interpreter and long decode loops, which the cheaper machine code slows, stay on the default).
A file the table does not list runs on the default code generation. `-n 0` and `-n 1` run
everything on the default."""

from __future__ import annotations

import collections
import functools
import json
import os
import statistics
from pathlib import Path

import pytest

TABLE = Path(__file__).with_name("durations.json")
SLOWEST = 30


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# The default run's marker expression (pyproject.toml's addopts); the split of the code
# generation holds only in a run that selects with it, the run the table's list was measured on
DEFAULT_MARKEXPR = "not extended and not compile_matrix and not full_matrix and not full_grid"
SPLIT = "EXPERTAX_TEST_CODEGEN_SPLIT"  # set by the controller for its workers


@functools.cache
def _table() -> dict:
    """tests/durations.json, read once per process (the scheduler asks at every hand-out)."""
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def file_seconds(markexpr: str = DEFAULT_MARKEXPR) -> dict[str, float]:
    """The measured seconds per test file (tests/durations.json) in the default run, or in the
    extended one for `-m extended`; {} without the table."""
    return _table().get("extended" if markexpr == "extended" else "files", {})


def cheap_codegen_files() -> frozenset[str]:
    """The files that may run on a worker with the tolerance-only code generation."""
    return frozenset(_table().get("cheap_codegen", ()))


def worker_codegen(worker: str | None, workers: int) -> str:
    """The code generation of xdist worker `worker` ("gw3"; None outside xdist) of `workers`:
    "cheap" on the odd-numbered ones when there are two or more and the controller split the
    run (`SPLIT`), else "default"."""
    if worker is None or workers < 2 or os.environ.get(SPLIT) != "1":
        return "default"
    return "cheap" if int(worker.removeprefix("gw")) % 2 else "default"


def _make_scheduler_class():
    from xdist.scheduler import LoadFileScheduling

    class CodegenFileScheduling(LoadFileScheduling):
        """`--dist loadfile` in the table's order, where a worker on the cheaper code
        generation takes only the files listed for it (the first of them in the queue) and
        stops when none is left, and a default worker takes the first file not listed, or,
        when only listed ones are left, the first of those."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            # the workers started (as each worker counts them), not those still running
            self.workers = len(config.getvalue("tx") or ())

        def _assign_work_unit(self, node):
            cheap = cheap_codegen_files()
            if worker_codegen(node.gateway.id, self.workers) == "cheap":
                scope = next((f for f in self.workqueue if _file_of(f) in cheap), None)
                if scope is None:
                    node.shutdown()
                    return
            else:
                scope = next((f for f in self.workqueue if _file_of(f) not in cheap), None)
            if scope is not None:
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return CodegenFileScheduling


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    return _make_scheduler_class()(config, log)


def pytest_collection_modifyitems(session, config, items):
    """Files in decreasing order of their measured seconds, each file's tests in their order."""
    known = file_seconds(config.getoption("markexpr", ""))
    if not known:
        return
    default = statistics.median(known.values())
    first_index: dict[str, int] = {}
    for i, item in enumerate(items):
        first_index.setdefault(_file_of(item.nodeid), i)
    items.sort(
        key=lambda it: (
            -known.get(_file_of(it.nodeid), default),
            first_index[_file_of(it.nodeid)],
        )
    )


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
        split = config.getoption("markexpr", "") == DEFAULT_MARKEXPR and bool(cheap_codegen_files())
        os.environ[SPLIT] = "1" if split else "0"


def _per_file(per_test: dict[str, float]) -> dict[str, float]:
    files: dict[str, float] = collections.defaultdict(float)
    for nodeid, s in per_test.items():
        files[_file_of(nodeid)] += s
    return dict(sorted(((f, round(s, 1)) for f, s in files.items()), key=lambda kv: -kv[1]))


def write_table(default: dict[str, float], extended: dict[str, float], note: str) -> None:
    """tests/durations.json from the per-test seconds (`EXPERTAX_DURATIONS_OUT`) of a default
    and an extended run: the seconds per file of each, rounded to 0.1 s; the `cheap_codegen`
    list is kept as it was measured, less the files without a default test."""
    table = {"measured": note, "files": _per_file(default), "extended": _per_file(extended)}
    # a file that no longer has a default test leaves the list (the split is the default run's)
    table["cheap_codegen"] = sorted(cheap_codegen_files() & set(table["files"]))
    TABLE.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":  # python -m tests.timing DEFAULT.json EXTENDED.json "how measured"
    import sys

    runs = [json.loads(Path(p).read_text()) for p in sys.argv[1:3]]
    write_table(*runs, sys.argv[3])
