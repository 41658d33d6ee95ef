"""Host memory: transparent huge pages for the large buffers XLA:CPU allocates on every step.

XLA:CPU allocates each step's temporaries (activations, gradients, optimizer updates) through the
C library's `malloc`. glibc serves large requests with fresh `mmap` regions that are returned on
`free`, so every step faults all of them in again, 4 KiB at a time: on the 2-core host of
BENCHMARKS.md a fresh buffer fills at about 5 GB/s against 50 GB/s for one already mapped.
glibc 2.35 and later can back those regions with transparent huge pages
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`: `madvise(MADV_HUGEPAGE)` on them), which cuts the
faults 512-fold. A tunable is read once, when the process starts, so the `expertax` command
re-executes itself with it set (`reexec_with_hugepages`); `EXPERTAX_HUGEPAGES=0` turns that off.
Nothing changes where the C library is not glibc >= 2.35 or the kernel's THP mode is `never`.
A Python program that imports expertax sets the variable itself, before it starts.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
SWITCH = "EXPERTAX_HUGEPAGES"  # "0": leave the allocator as it is
MIN_GLIBC = (2, 35)  # first glibc with the hugetlb tunable


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the glibc this interpreter runs on, or None for another C library."""
    name, version = platform.libc_ver()
    if name != "glibc":
        return None
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _without_tunable(tunables: str) -> list[str]:
    return [t for t in tunables.split(":") if t and not t.startswith(TUNABLE + "=")]


def hugepage_env(environ: Mapping[str, str], on: bool = True) -> dict[str, str] | None:
    """The environment to re-execute with so that `glibc.malloc.hugetlb` is 1 (`on`) or unset,
    or None when `environ` already is that way, glibc is too old or absent, or `SWITCH` is "0"
    (for `on`). Other tunables in `GLIBC_TUNABLES` are kept."""
    if on and environ.get(SWITCH, "1") == "0":
        return None
    version = glibc_version()
    if version is None or version < MIN_GLIBC:
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    current = [t for t in tunables.split(":") if t.startswith(TUNABLE + "=")]
    if current == ([f"{TUNABLE}=1"] if on else []):
        return None
    kept = _without_tunable(tunables) + ([f"{TUNABLE}=1"] if on else [])
    env = {k: v for k, v in environ.items() if k != "GLIBC_TUNABLES"}
    if kept:
        env["GLIBC_TUNABLES"] = ":".join(kept)
    return env


def reexec_with_hugepages(cmd: list[str], on: bool = True) -> None:
    """Replace this process by `cmd` (its argv, e.g. `[sys.executable, "-m", "expertax.cli",
    ...]`) with huge pages turned `on` (or off), unless the environment already says so.
    Call it before any work is done: nothing after a re-execution runs in this process."""
    env = hugepage_env(os.environ, on)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, cmd, env)


def hugepages_active() -> bool:
    """Whether this process started with `glibc.malloc.hugetlb=1` on a glibc that reads it."""
    version = glibc_version()
    tunables = os.environ.get("GLIBC_TUNABLES", "").split(":")
    return version is not None and version >= MIN_GLIBC and f"{TUNABLE}=1" in tunables


def command() -> int:
    """The `expertax` console command: `expertax.cli.main` in a process with huge pages on
    (re-executed once, before anything else is imported; `EXPERTAX_HUGEPAGES=0`: as it is)."""
    reexec_with_hugepages([sys.executable, "-m", "expertax.cli", *sys.argv[1:]])
    from expertax.cli import main

    return main()
