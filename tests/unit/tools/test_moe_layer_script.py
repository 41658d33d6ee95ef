"""`benchmarks/moe_layer.py --malloc retain`: the glibc tunables it re-executes with."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "moe_layer.py"


def _script():
    spec = importlib.util.spec_from_file_location("moe_layer_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_retain_adds_its_tunables_keeps_others_and_is_idempotent():
    m = _script()
    env = m._retain_env({"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, True)
    tunables = env["GLIBC_TUNABLES"].split(":")
    assert tunables == ["glibc.malloc.hugetlb=1", *m.RETAIN_TUNABLES]
    assert env["A"] == "1"
    assert m._retain_env(env, True) is None  # already so: no re-execution
    # A user's own value for one of the keys is replaced, not duplicated.
    env = m._retain_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, True)
    assert env["GLIBC_TUNABLES"].split(":") == list(m.RETAIN_TUNABLES)


def test_default_removes_only_the_retain_tunables():
    m = _script()
    both = "glibc.malloc.hugetlb=1:" + ":".join(m.RETAIN_TUNABLES)
    assert m._retain_env({"GLIBC_TUNABLES": both}, False)["GLIBC_TUNABLES"] == (
        "glibc.malloc.hugetlb=1"
    )
    assert "GLIBC_TUNABLES" not in m._retain_env(
        {"GLIBC_TUNABLES": ":".join(m.RETAIN_TUNABLES)}, False
    )
    assert m._retain_env({"B": "2"}, False) is None
