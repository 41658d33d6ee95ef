"""Products of a few float32 rows by weight matrices on a CPU, by our own kernel (rowdot.cc).

A decode step multiplies one to a few rows by every weight it holds: products bound by reading
the weights from memory. XLA:CPU runs a 1-row product of a matrix up to 2 MiB on one thread and
its 2-8-row products at 8-20 GB/s (docs/design/generate.md, "Products at decode shapes"), where this
host's two cores read 28-30 GB/s. No library that JAX can call provides faster ones, so expertax
has its own: `rowdot.cc`, an XLA FFI custom call that streams each weight once per 8 rows, on
its own helper threads and the calling one. A row can pick its matrix
out of several (`ids`): a MoE layer's routed rows read their experts' weights in place, the rows
that chose one expert together, and MLA's absorbed products run per head in one call.

The kernel is compiled from its source on first use with the system's C++ compiler (`$CXX`, else
`c++`, with `-O3 -march=native`) into `$XDG_CACHE_HOME/expertax` (default `~/.cache/expertax`),
named by a hash of the source, the compiler, jaxlib and the CPU's flags. Where that fails (no
compiler) decoding uses XLA's products and `reason()` says why. It serves the decode programs
traced for a mesh of one CPU device (`use`, decoding/programs.py) on float32 rows and weights,
at most `MAX_ROWS` rows per call (longer ones, e.g. prefills, are XLA's); `EXPERTAX_ROWDOT=0`
turns it off.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from expertax.nn import linear

SWITCH = "EXPERTAX_ROWDOT"  # "0": XLA's products
TARGET = "expertax_rowdot"
SOURCE = Path(__file__).with_name("rowdot.cc")
# Rows per call above which XLA's matrix products (blocked for many rows) are used instead.
MAX_ROWS = 16
F32 = jnp.float32
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")

_STATE: dict = {}
_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("rowdot", default=False)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def library_path() -> Path:
    """The compiled kernel, built now if it is not in the cache (RuntimeError if it cannot be)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler: neither $CXX nor c++/g++ on PATH")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [source, cxx.encode(), " ".join(FLAGS).encode(), jaxlib.__version__.encode()]
            + [_cpu_flags().encode()]
        )
    ).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "expertax"
    out = root / f"rowdot-{key}.so"
    if out.exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders leave one complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def available() -> bool:
    """Whether the kernel is built and registered with XLA (built on the first call)."""
    if "ok" not in _STATE:
        try:
            lib = ctypes.CDLL(str(library_path()))
            capsule = jax.ffi.pycapsule(lib.ExpertaxRowDot)
            jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu")
            _STATE.update(ok=True, lib=lib, reason=None)
        except (OSError, RuntimeError, AttributeError) as e:
            _STATE.update(ok=False, reason=str(e))
    return _STATE["ok"]


def reason() -> str | None:
    """Why the kernel is unavailable (None when it is, or was not asked for yet)."""
    return _STATE.get("reason")


def wanted(mesh) -> bool:
    """Whether programs traced for `mesh` use the kernel: one CPU device, not switched off, and
    the kernel builds."""
    if os.environ.get(SWITCH, "1") == "0" or mesh.size != 1:
        return False
    return mesh.devices.flat[0].platform == "cpu" and available()


@contextlib.contextmanager
def use(on: bool):
    """Programs traced inside use the kernel where it applies (`on`), else XLA's products: every
    `nn.linear.project` and `per_head`, and the MoE layer's per-expert products
    (nn/moe/unstacked.py), through `nn.linear`'s row-kernel seam."""
    token = _ON.set(on)
    try:
        with linear.row_kernel(linear.RowKernel(applies, rows) if on else None):
            yield
    finally:
        _ON.reset(token)


def applies(rows: int, *arrays) -> bool:
    """Whether the kernel serves a product of `rows` rows (per matrix) by float32 `arrays` in
    the program being traced."""
    return _ON.get() and 0 < rows <= MAX_ROWS and all(a.dtype == F32 for a in arrays)


def rows(x_RK, ws, ids_R=None):
    """y[r] = x[r] @ W[ids[r]] -> float32 [R, N] by the kernel, the matrices W numbered through
    `ws` (each [K, N] or [G, K, N]) in order; ids default to 0 (one matrix)."""
    n = ws[0].shape[-1]
    if ids_R is None:
        ids_R = jnp.zeros((x_RK.shape[0],), jnp.int32)
    out = jax.ShapeDtypeStruct((x_RK.shape[0], n), F32)
    return jax.ffi.ffi_call(TARGET, out)(x_RK, ids_R.astype(jnp.int32), *ws)
