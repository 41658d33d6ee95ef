"""The `expertax` command's huge-page setting (expertax.hostmem, step 1 of cli.command)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from expertax import cli, hostmem

ON = "glibc.malloc.hugetlb=1"


@pytest.fixture
def glibc(monkeypatch):
    monkeypatch.setattr(hostmem.platform, "libc_ver", lambda: ("glibc", "2.36"))


def test_env_adds_the_tunable_and_keeps_others(glibc):
    assert hostmem.hugepage_env({"A": "1"})["GLIBC_TUNABLES"] == ON
    env = hostmem.hugepage_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{ON}"
    env = hostmem.hugepage_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert env["GLIBC_TUNABLES"] == ON


def test_env_unchanged_when_set_switched_off_or_not_glibc(glibc, monkeypatch):
    assert hostmem.hugepage_env({"GLIBC_TUNABLES": ON}) is None
    assert hostmem.hugepage_env({hostmem.SWITCH: "0"}) is None
    monkeypatch.setattr(hostmem.platform, "libc_ver", lambda: ("glibc", "2.31"))
    assert hostmem.hugepage_env({}) is None
    monkeypatch.setattr(hostmem.platform, "libc_ver", lambda: ("", ""))
    assert hostmem.hugepage_env({}) is None


def test_env_off_removes_only_the_tunable(glibc):
    env = hostmem.hugepage_env({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{ON}"}, on=False)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    assert "GLIBC_TUNABLES" not in hostmem.hugepage_env({"GLIBC_TUNABLES": ON}, on=False)
    assert hostmem.hugepage_env({}, on=False) is None


def test_env_unchanged_when_the_tunable_is_set_among_others(glibc):
    assert hostmem.hugepage_env({"GLIBC_TUNABLES": f"{ON}:glibc.malloc.arena_max=2"}) is None


def test_retain_env_sets_replaces_and_removes_only_its_tunables(glibc, monkeypatch):
    retain = list(hostmem.RETAIN_TUNABLES)
    env = hostmem.retain_env({"A": "1", "GLIBC_TUNABLES": ON}, True)
    assert env["GLIBC_TUNABLES"].split(":") == [ON, *retain] and env["A"] == "1"
    assert hostmem.retain_env(env, True) is None  # already so: no re-execution
    # a user's own value for one of its keys is replaced, not duplicated
    env = hostmem.retain_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, True)
    assert env["GLIBC_TUNABLES"].split(":") == retain
    both = ":".join([ON, *retain])
    assert hostmem.retain_env({"GLIBC_TUNABLES": both}, False)["GLIBC_TUNABLES"] == ON
    assert hostmem.retain_env({"B": "2"}, False) is None
    monkeypatch.setattr(hostmem.platform, "libc_ver", lambda: ("", ""))
    assert hostmem.retain_env({}, True) is None


def test_reexec_sets_huge_pages_and_retain_together(glibc, monkeypatch):
    calls = []
    monkeypatch.setattr(hostmem.os, "execve", lambda path, argv, env: calls.append(env))
    monkeypatch.delenv(hostmem.SWITCH, raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    hostmem.reexec_with_hugepages(["x"], on=True, retain=True)
    assert calls[-1]["GLIBC_TUNABLES"].split(":") == [ON, *hostmem.RETAIN_TUNABLES]
    monkeypatch.setenv("GLIBC_TUNABLES", ":".join([ON, *hostmem.RETAIN_TUNABLES]))
    hostmem.reexec_with_hugepages(["x"], on=True, retain=True)  # already so
    hostmem.reexec_with_hugepages(["x"], on=True)  # retain=None leaves the user's tunables
    assert len(calls) == 1
    hostmem.reexec_with_hugepages(["x"], on=True, retain=False)
    assert calls[-1]["GLIBC_TUNABLES"] == ON


def test_command_reexecutes_once_with_the_tunable(glibc, monkeypatch):
    calls = []

    def fake_execve(path, argv, env):
        calls.append((path, argv, env))
        raise SystemExit(0)

    monkeypatch.setattr(hostmem.os, "execve", fake_execve)
    monkeypatch.setattr(sys, "argv", ["expertax", "train", "steps=1"])
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(hostmem.SWITCH, raising=False)
    with pytest.raises(SystemExit):
        cli.command()
    [(path, argv, env)] = calls
    assert argv == [sys.executable, "-m", "expertax.cli", "train", "steps=1"]
    assert env["GLIBC_TUNABLES"] == ON
    # negative control: switched off, the command runs here (main sees --help and exits 0)
    monkeypatch.setenv(hostmem.SWITCH, "0")
    monkeypatch.setattr(sys, "argv", ["expertax", "--help"])
    with pytest.raises(SystemExit) as e:
        cli.command()
    assert e.value.code == 0 and len(calls) == 1


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else ""
    return text.split("[")[1].split("]")[0] if "[" in text else "none"


# A child that mallocs 256 MiB, touches it, and prints its huge-page-backed anonymous KiB.
_CHILD = """
import ctypes
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
p = libc.malloc(256 << 20)
ctypes.memset(p, 1, 256 << 20)
rollup = open("/proc/self/smaps_rollup").read().splitlines()
print(sum(int(l.split()[1]) for l in rollup if l.startswith("AnonHugePages")))
"""


@pytest.mark.skipif(
    hostmem.glibc_version() is None
    or hostmem.glibc_version() < hostmem.MIN_GLIBC
    or _thp_mode() != "madvise",
    reason="needs glibc >= 2.35 and THP in madvise mode",
)
def test_the_tunable_backs_malloc_with_huge_pages():
    """The mechanism itself: with the tunable a large malloc is huge-page backed; without it
    (negative control; THP in madvise mode) it is not."""

    def huge_kib(env_on: bool) -> int:
        env = hostmem.hugepage_env({}, on=env_on) or {}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
        )
        return int(out.stdout)

    assert huge_kib(True) >= 128 << 10
    assert huge_kib(False) == 0
