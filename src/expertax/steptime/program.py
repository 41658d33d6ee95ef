"""The step time of expertax's own compiled train step (`expertax memory` on a TPU or GPU
target, and each `--fit` candidate), and a program saved for `expertax steptime`: its HLO text
and, beside it, what the text does not say (the target, the mesh, where each device sits, the
model's FLOPs and tokens per device)."""

from __future__ import annotations

from expertax.steptime import topology
from expertax.steptime.report import estimate, json_ready

META_SUFFIX = ".meta.json"


def model_figures(c, trainer) -> tuple[float, float]:
    """(model FLOPs, tokens) per device and step."""
    from expertax.planner.costs import model_flops_per_device

    tokens = trainer.global_batch * c.max_target_length / trainer.num_devices
    return model_flops_per_device(c, trainer.global_batch, trainer.num_devices), tokens


def predict(text: str, c, trainer, target) -> dict | None:
    """The step-time report of the program `text` (None on the CPU: no chip to time it on);
    `_simulator` kept for a plot."""
    if target is None or target.chip is None:
        return None
    placement = topology.mesh_placement(target, trainer.mesh)
    flops, tokens = model_figures(c, trainer)
    host = target.chip.host.link_bytes_per_s if target.chip.host else 0.0
    return estimate(
        text,
        placement,
        host_bytes_per_s=host,
        model_flops=flops,
        tokens=tokens,
        target=target.spec,
    )


def save(path: str, text: str, c, trainer, target) -> None:
    """Write the program's text to `path` and its facts to `path + META_SUFFIX`."""
    from expertax.jsonio import dump

    flops, tokens = model_figures(c, trainer)
    meta: dict = {
        "target": None if target is None else target.spec,
        "mesh": [[a, int(n)] for a, n in zip(trainer.mesh.axis_names, trainer.mesh.devices.shape)],
        "devices": int(trainer.mesh.devices.size),
        "model_flops": flops,
        "tokens": tokens,
        "model_name": c.model_name,
    }
    if target is not None and target.chip is not None:
        placement = topology.mesh_placement(target, trainer.mesh)
        meta["coords"] = [list(x) for x in placement.coords]
        meta["placement"] = placement.source
    with open(path, "w") as f:
        f.write(text)
    with open(path + META_SUFFIX, "w") as f:
        dump(meta, f, indent=1)


def summary(report: dict | None) -> dict | None:
    return None if report is None else json_ready(report)
