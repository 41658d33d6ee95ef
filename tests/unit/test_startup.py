"""The `expertax` command's quiet start (expertax/startup.py): the hardware it finds, the platforms
it gives JAX, the lines it drops and those it keeps."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from expertax import startup

CUDART = (
    "I0000 00:00:1795780590.775080    2426 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.\n"
)
ABSL = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
LIBTPU = (
    "Failed to find host bounds for accelerator type: WARNING: could not determine TPU "
    "accelerator type, please set env var `TPU_ACCELERATOR_TYPE` manually\n"
)


def _pci(root: Path, slot: str, vendor: str, cls: str, device: str = "0x0000") -> None:
    d = root / "sys/bus/pci/devices" / slot
    d.mkdir(parents=True)
    for name, value in (("vendor", vendor), ("class", cls), ("device", device)):
        (d / name).write_text(value + "\n")


def test_accelerators_from_pci_and_device_nodes(tmp_path):
    assert startup.accelerators(tmp_path) == set()
    # A Google VM's virtual NIC and an NVIDIA GPU's audio function are not accelerators.
    _pci(tmp_path, "0000:00:04.0", "0x1ae0", "0x020000", "0x0042")
    _pci(tmp_path, "0000:00:05.0", "0x10de", "0x040300")
    assert startup.accelerators(tmp_path) == set()
    _pci(tmp_path, "0000:00:06.0", "0x10de", "0x030200")  # an H100: 3D controller
    assert startup.accelerators(tmp_path) == {"gpu"}
    _pci(tmp_path, "0000:00:07.0", "0x1ae0", "0x120000", "0x0062")  # a TPU v5p chip
    assert startup.accelerators(tmp_path) == {"gpu", "tpu"}
    # A container that sees the driver's device nodes but no PCI tree.
    nodes = tmp_path / "container"
    (nodes / "dev").mkdir(parents=True)
    (nodes / "dev/nvidiactl").write_text("")
    assert startup.accelerators(nodes) == {"gpu"}


def test_platforms_follow_the_hardware_and_the_plugins():
    every, none = (lambda _: True), (lambda _: False)
    assert startup.platforms(set(), every) == ("cpu", [])
    assert startup.platforms({"gpu"}, every) == ("cuda,cpu", [])
    assert startup.platforms({"gpu", "tpu"}, every) == ("cuda,tpu,cpu", [])
    chosen, notes = startup.platforms({"gpu"}, none)
    assert chosen == "cpu" and len(notes) == 1
    assert "has a GPU but JAX's GPU plugin is not installed" in notes[0]
    assert "pip install 'jax[cuda12]'" in notes[0]


def test_benign_only_where_the_hardware_is_absent():
    assert startup.benign(CUDART, set()) and startup.benign(ABSL, set())
    assert startup.benign(LIBTPU, {"gpu"})
    # On a machine that has the GPU, the same line reports a real problem: kept.
    assert not startup.benign(CUDART, {"gpu"})
    assert not startup.benign(LIBTPU, {"tpu"})
    assert not startup.benign("E0000 cuda_executor.cc:1] CUDA_ERROR_NO_DEVICE\n", set())
    assert not startup.benign("Traceback (most recent call last):\n", set())


def test_quiet_native_logs_drops_the_benign_and_keeps_the_rest(capfd):
    with startup.quiet_native_logs(set()):
        os.write(2, (ABSL + CUDART + "a real error\n" + LIBTPU + "and another\n").encode())
    assert capfd.readouterr().err == "a real error\nand another\n"
    with startup.quiet_native_logs({"gpu", "tpu"}):  # the hardware is here: nothing dropped
        os.write(2, (ABSL + CUDART).encode())
    assert capfd.readouterr().err == ABSL + CUDART
    with pytest.raises(RuntimeError), startup.quiet_native_logs(set()):  # an error inside
        os.write(2, b"why it failed\n")
        raise RuntimeError("boom")
    assert capfd.readouterr().err == "why it failed\n"


def test_compile_only_tpu_environment_keeps_the_users_settings(monkeypatch):
    monkeypatch.setattr(startup, "accelerators", lambda root="/": set())
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "mine")
    startup.compile_only_tpu_environment("v5p-16")
    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v5p-16"
    assert os.environ["TPU_WORKER_HOSTNAMES"] == "mine"


SRC = str(Path(startup.__file__).parents[1])
HAVE_BOTH = all(importlib.util.find_spec(p) for p in ("libtpu", "jax_plugins.xla_cuda12"))


@pytest.mark.skipif(
    not HAVE_BOTH or startup.accelerators(), reason="needs the tpu and gpu extras, no accelerator"
)
def test_a_start_with_both_compilers_installed_is_silent():
    """What the command does before its first line, in a fresh process with no JAX_PLATFORMS:
    import JAX, start the backends, describe a TPU slice and a GPU host. Nothing on stderr."""
    code = (
        "from expertax import startup\n"
        "startup.prepare()\n"
        "import jax\n"
        "from expertax import targets\n"
        "tpu, gpu = targets.parse_target('tpu:v5p-16'), targets.parse_target('gpu:h100x8')\n"
        "targets.prepare_process(tpu)\n"
        "startup.start_backends()\n"
        "print(jax.default_backend(), len(tpu.devices()), len(gpu.devices()))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "TPU_", "XLA_"))}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["cpu", "8", "8"]
    assert out.stderr == ""
