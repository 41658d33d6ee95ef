"""Host memory: transparent huge pages for the large buffers XLA:CPU allocates on every step.

XLA:CPU allocates each step's temporaries (activations, gradients, optimizer updates) through the
C library's `malloc`. glibc serves large requests with fresh `mmap` regions that are returned on
`free`, so every step faults all of them in again, 4 KiB at a time: on the 2-core host of
BENCHMARKS.md a fresh buffer fills at about 5 GB/s against 50 GB/s for one already mapped.
glibc 2.35 and later can back those regions with transparent huge pages
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`: `madvise(MADV_HUGEPAGE)` on them), which cuts the
faults 512-fold. A tunable is read once, when the process starts, so the `expertax` command
(`cli.command`, its first step) re-executes itself with it set (`reexec_with_hugepages`);
`EXPERTAX_HUGEPAGES=0` turns that off.
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


# `retain` (benchmarks only, not the command's default): large blocks from the heap instead of
# fresh mappings, never trimmed, one arena, so freed memory is reused without the kernel clearing
# its pages again. XLA:CPU mallocs each execution's temporaries (per simulated device) and frees
# them after; simulated devices then pay a page clearing that follows the buffer sizes, which a
# device allocator's pool does not (BENCHMARKS.md, MoE layer). On one device it
# did not help the train step.
RETAIN_TUNABLES = (
    "glibc.malloc.mmap_max=0",
    f"glibc.malloc.trim_threshold={2**40}",
    "glibc.malloc.arena_max=1",
)


def _key(tunable: str) -> str:
    return tunable.split("=")[0]


def _tunables_env(environ: Mapping[str, str], wanted: tuple[str, ...], keys: set[str]):
    """`environ` whose `GLIBC_TUNABLES` sets exactly `wanted` among the tunables named `keys`
    (others kept, in order), or None when it already does."""
    tunables = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    if sorted(t for t in tunables if _key(t) in keys) == sorted(wanted):
        return None
    kept = [t for t in tunables if _key(t) not in keys] + list(wanted)
    env = {k: v for k, v in environ.items() if k != "GLIBC_TUNABLES"}
    if kept:
        env["GLIBC_TUNABLES"] = ":".join(kept)
    return env


def hugepage_env(environ: Mapping[str, str], on: bool = True) -> dict[str, str] | None:
    """The environment to re-execute with so that `glibc.malloc.hugetlb` is 1 (`on`) or unset,
    or None when `environ` already is that way, glibc is too old or absent, or `SWITCH` is "0"
    (for `on`). Other tunables in `GLIBC_TUNABLES` are kept."""
    if on and environ.get(SWITCH, "1") == "0":
        return None
    version = glibc_version()
    if version is None or version < MIN_GLIBC:
        return None
    return _tunables_env(environ, (f"{TUNABLE}=1",) if on else (), {TUNABLE})


def retain_env(environ: Mapping[str, str], on: bool) -> dict[str, str] | None:
    """The environment with `RETAIN_TUNABLES` set (`on`) or removed, or None when it already is
    that way or the C library is not glibc. Other tunables are kept."""
    if glibc_version() is None:
        return None
    return _tunables_env(environ, RETAIN_TUNABLES if on else (), {_key(t) for t in RETAIN_TUNABLES})


def reexec_with_hugepages(cmd: list[str], on: bool = True, retain: bool | None = None) -> None:
    """Replace this process by `cmd` (its argv, e.g. `[sys.executable, "-m", "expertax.cli",
    ...]`) with huge pages turned `on` (or off) and, unless `retain` is None, `RETAIN_TUNABLES`
    set or removed, unless the environment already says so. Call it before any work is done:
    nothing after a re-execution runs in this process."""
    env = hugepage_env(os.environ, on)
    if retain is not None:
        env = retain_env(env or os.environ, retain) or env
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


def retain_active() -> bool:
    """Whether this process started with `RETAIN_TUNABLES` on glibc."""
    tunables = os.environ.get("GLIBC_TUNABLES", "").split(":")
    return glibc_version() is not None and all(t in tunables for t in RETAIN_TUNABLES)


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc's `malloc_trim`): a process that
    compiles one large program after another (the fit search) otherwise keeps the first one's
    peak as its floor. False where the C library has no such call."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
