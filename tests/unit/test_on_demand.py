"""No test runs nowhere: a test on demand (`full_grid`, `compile_matrix`, `full_matrix`, run by
neither the default run nor CI) names, with `covered_by`, the tests of the default or extended
run that take its code path with the same kind of assertion, and those exist and run in CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ON_DEMAND

CI_MARKERS = ("extended",)  # CI's second run; the default run is everything not on demand


@pytest.fixture(scope="module")
def items(tmp_path_factory) -> dict:
    """Every test's markers and covered_by, from one collection of the whole suite."""
    out = tmp_path_factory.mktemp("collection") / "collection.json"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-m", "", "tests"],
        env=dict(os.environ, EXPERTAX_COLLECTION_OUT=str(out)),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_on_demand_test_names_ci_tests_that_cover_it(items):
    on_demand = {n for n, r in items.items() if set(r["markers"]) & set(ON_DEMAND)}
    assert on_demand, "the collection holds no on-demand test: the check would be empty"
    missing = sorted(n for n in on_demand if not items[n]["covered_by"])
    assert not missing, f"on-demand tests without covered_by: {missing}"
    unknown, also_on_demand = [], []
    for n in sorted(on_demand):
        for target in items[n]["covered_by"]:
            if target not in items:
                unknown.append((n, target))
            elif target in on_demand:
                also_on_demand.append((n, target))
    assert not unknown, f"covered_by names tests that do not exist: {unknown}"
    assert not also_on_demand, f"covered_by names tests that run on demand too: {also_on_demand}"
    # and covered_by only where it means something
    stray = sorted(n for n, r in items.items() if r["covered_by"] and n not in on_demand)
    assert not stray, f"covered_by on tests that CI runs: {stray}"


def test_the_schedule_finds_every_default_codegen_test(items):
    """tests/timing.py reads the `default_codegen` marker from the decorators (the controller
    schedules before any collection): a marker given otherwise (a parametrize case's marks, a
    module's pytestmark) would send the test to a worker on the cheaper code generation."""
    from tests import timing

    marked = {n for n, r in items.items() if timing.MARKER in r["markers"]}
    assert marked, "no test is marked: the check would be empty"
    found = {n for n in items if timing.scope_of(n).endswith("::default_codegen")}
    assert found == marked
