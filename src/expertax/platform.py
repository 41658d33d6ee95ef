"""The platform a program is built for, read from its devices, not from `jax.default_backend()`.

A train step compiled for a TPU slice or for GPUs from a CPU machine (`--target`) traces with the
CPU as JAX's default backend; every backend decision (the all-to-all implementation, the grouped
matmul's and attention's kernels, host offload, the planner's notes) must follow the mesh's
devices instead. `Trainer.context()` sets the platform of its mesh (and one of its devices) for
the code traced under it; outside such a context `current()` is the default backend's and
`device()` is None.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

ACCELERATORS = ("gpu", "tpu")
_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("platform", default=None)
_DEVICE: contextvars.ContextVar = contextvars.ContextVar("platform_device", default=None)


def normalize(platform: str) -> str:
    """`cuda` and `rocm` (device.platform of some clients) are `gpu`, as JAX's backends say."""
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def of_devices(devices) -> str:
    devices = list(devices)
    return normalize(devices[0].platform) if devices else normalize(jax.default_backend())


def of_mesh(mesh) -> str:
    return of_devices(mesh.devices.flat)


def planned() -> str:
    """The platform of JAX's default backend, where possible without starting a backend: the
    first of the platforms `jax_platforms` ($JAX_PLATFORMS, which `expertax` sets) lists, to
    which JAX gives the highest priority; else the started default backend's."""
    first = (getattr(jax.config, "jax_platforms", None) or "").split(",")[0].strip()
    return normalize(first) if first else normalize(jax.default_backend())


def current() -> str:
    """The platform being traced for: the innermost `use()`, else JAX's default backend."""
    return _CURRENT.get() or normalize(jax.default_backend())


def device():
    """A device of the platform being traced for (the innermost `use()` that named one), or None.

    Kernel libraries that read the GPU generation from JAX's default device (tokamax) need one
    of the target's devices while a program for it is traced on a CPU machine."""
    return _DEVICE.get()


@contextlib.contextmanager
def use(platform: str, device=None):
    token = _CURRENT.set(normalize(platform))
    device_token = _DEVICE.set(device)
    try:
        yield
    finally:
        _DEVICE.reset(device_token)
        _CURRENT.reset(token)


def has_pinned_host(devices=None) -> bool:
    """Whether the devices have pinned host memory to offload to. GPU and TPU clients do; the
    GPU compiler without a GPU lists no memories but compiles pinned-host placements."""
    devices = list(jax.devices() if devices is None else devices)
    platform = of_devices(devices)
    try:
        kinds = {m.kind for m in devices[0].addressable_memories()}
    except Exception:  # noqa: BLE001 - backends without the memories API
        kinds = set()
    return "pinned_host" in kinds or (platform in ACCELERATORS and not kinds)
