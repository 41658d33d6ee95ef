"""A quiet start for the `expertax` command: JAX starts only the platforms this machine has, and
the accelerator plugins' start-up chatter is dropped where it only says that the hardware is
absent.

With the `tpu` and `gpu` extras installed on a machine without a TPU or GPU, a bare `import jax`
prints a few lines of the CUDA plugin's native log ("cudart_stub.cc ... Could not find cuda
drivers", each after absl's "All log messages before absl::InitializeLog()" line), starting the
backends adds the plugin's traceback, and loading libtpu for a compile-only TPU target adds its
complaints about the TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES it cannot read from a TPU
VM's metadata. None of it is wrong, and none of it is news to someone who has no GPU or TPU.

What the command does instead (`prepare()`, before anything imports JAX):
- `$JAX_PLATFORMS`, when the user has not set it, lists the platforms whose hardware this machine
  has (`accelerators()`: an NVIDIA display/3D controller or its device nodes; a Google TPU chip)
  and whose JAX plugin is installed, then `cpu`. A machine with a GPU whose plugin cannot start
  then fails loudly at its first use of JAX (JAX: "Unable to initialize backend 'cuda'"), where
  JAX alone would fall back to the CPU with a warning; hardware without its plugin gets one line
  that says so and how to install it.
- JAX is imported with the process's standard error (file descriptor 2, where native libraries
  write) captured; what was captured is written back, less the lines that `benign()` knows to
  mean "no such hardware here" when the hardware is indeed absent. Everything else, including
  any Python warning or error of the import, comes through unchanged.
- A compile-only TPU target gives libtpu the two settings a TPU VM's metadata would
  (`compile_only_tpu_environment`), when no TPU is attached.

`quiet_native_logs()` is the same capture for other native start-ups (the accelerator compilers'
topology descriptions, `targets.py`). Only the standard library here: this runs before JAX.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

NVIDIA_PCI_VENDOR = "0x10de"
GOOGLE_PCI_VENDOR = "0x1ae0"
PCI_DISPLAY_CLASS = "0x03"  # VGA / 3D controllers: an NVIDIA GPU, not its audio or switch chips
PCI_ACCELERATOR_CLASS = "0x12"  # processing accelerators
# Google's PCI device ids of TPU chips (v2/v3 onwards); Google's other PCI devices on a cloud VM
# (its virtual NIC, its NVMe) are network and storage controllers.
TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}
NVIDIA_DEVICE_NODES = ("dev/nvidia0", "dev/nvidiactl", "dev/dxg", "proc/driver/nvidia/version")
TPU_DEVICE_NODES = ("dev/accel0",)

# JAX's name of each platform, and the plugin packages that provide it.
PLUGINS = {
    "gpu": ("cuda", ("jax_cuda13_plugin", "jax_cuda12_plugin"), "pip install 'jax[cuda12]'"),
    "tpu": ("tpu", ("libtpu",), "pip install 'jax[tpu]'"),
}

# Lines that mean only "this hardware is not here", by the hardware whose absence they report.
BENIGN = {
    "gpu": (
        re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"),
        re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called"),
    ),
    "tpu": (
        re.compile(r"could not determine TPU (accelerator type|worker hostnames)"),
        re.compile(r"^WARNING: Logging before InitGoogle\(\) is written to STDERR"),
        re.compile(r"^=== Source Location Trace: ===\s*$"),
        re.compile(r"^learning/.*libtpu_init_utils\.cc:\d+\s*$"),
        re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called"),
    ),
}


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def accelerators(root: str | Path = "/") -> set[str]:
    """The accelerators attached to this machine: "gpu" (NVIDIA), "tpu" (Google), from the PCI
    devices under `root`/sys and the device nodes the drivers create."""
    root = Path(root)
    found = set()
    for dev in sorted((root / "sys/bus/pci/devices").glob("*")):
        vendor, cls = _read(dev / "vendor"), _read(dev / "class")
        if vendor == NVIDIA_PCI_VENDOR and cls.startswith(PCI_DISPLAY_CLASS):
            found.add("gpu")
        if vendor == GOOGLE_PCI_VENDOR and (
            _read(dev / "device") in TPU_PCI_DEVICES or cls.startswith(PCI_ACCELERATOR_CLASS)
        ):
            found.add("tpu")
    if any((root / p).exists() for p in NVIDIA_DEVICE_NODES):
        found.add("gpu")
    if any((root / p).exists() for p in TPU_DEVICE_NODES):
        found.add("tpu")
    return found


def installed(packages: Iterable[str]) -> bool:
    return any(importlib.util.find_spec(p) is not None for p in packages)


def platforms(present: set[str], has_package=installed) -> tuple[str, list[str]]:
    """(JAX_PLATFORMS for the hardware `present`, notes on hardware without its plugin)."""
    names, notes = [], []
    for hw, (name, packages, install) in PLUGINS.items():
        if hw not in present:
            continue
        if has_package(packages):
            names.append(name)
        else:
            notes.append(
                f"expertax: this machine has a {hw.upper()} but JAX's {hw.upper()} plugin is "
                f"not installed ({install}); running on the CPU"
            )
    return ",".join([*names, "cpu"]), notes


def benign(line: str, present: set[str]) -> bool:
    """Whether `line` only reports the absence of hardware that is indeed absent."""
    return any(
        pattern.search(line) for hw, ps in BENIGN.items() if hw not in present for pattern in ps
    )


@contextlib.contextmanager
def quiet_native_logs(present: set[str] | None = None) -> Iterator[None]:
    """Capture file descriptor 2 (native libraries' logs and Python's stderr) for the duration,
    then write back every captured line that is not `benign` for the hardware `present`
    (default: `accelerators()`)."""
    present = accelerators() if present is None else present
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True) if not benign(line, present)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def compile_only_tpu_environment(accelerator_type: str) -> None:
    """libtpu, loaded to compile for a TPU slice on a machine with no TPU, reads the slice's
    accelerator type and its workers' hostnames from a TPU VM's metadata server; without one it
    logs an error for each. Tell it instead: the target's type, and this host alone."""
    if "tpu" in accelerators():
        return
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


_CHOSEN: list[str] = []  # the JAX_PLATFORMS `prepare` set, if it set one


def chosen_platforms() -> str | None:
    """The $JAX_PLATFORMS this process's `prepare` chose (None: the user's, or none set)."""
    return _CHOSEN[-1] if _CHOSEN and os.environ.get("JAX_PLATFORMS") == _CHOSEN[-1] else None


def prepare() -> None:
    """Choose JAX's platforms from this machine's hardware (unless $JAX_PLATFORMS is set) and
    import JAX with the absent hardware's start-up lines dropped (see the module docstring)."""
    present = accelerators()
    if "JAX_PLATFORMS" not in os.environ:
        chosen, notes = platforms(present)
        os.environ["JAX_PLATFORMS"] = chosen
        _CHOSEN.append(chosen)
        for note in notes:
            print(note, file=sys.stderr)
    _PRESENT[:] = [present]
    if "jax" in sys.modules:
        return
    with quiet_native_logs(present):
        import jax  # noqa: F401


_PRESENT: list[set[str]] = []  # what `prepare` found, so that it is read once per process


def start_backends() -> None:
    """Start JAX's backends now, with the absent hardware's start-up lines dropped: JAX loads
    every installed plugin's native library when its first backend starts (the CUDA plugin
    logs again then). Call where the command first needs devices, after what must precede
    a backend (jax.distributed.initialize, the simulated CPU device count)."""
    import jax

    with quiet_native_logs(_PRESENT[0] if _PRESENT else None):
        jax.devices()
