"""`expertax steptime PROGRAM --target T`: the step time predicted from a compiled program's
optimized HLO text (expertax's, saved by `expertax memory --save-program`, or any JAX
program's `jit(f).lower(...).compile().as_text()`), with its parts (expertax/steptime/)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from expertax.errors import ConfigError
from expertax.outputs import add_overwrite_flag, check_apart, check_file
from expertax.paths import read_text, require_file, what_is

HELP = "step time predicted from a compiled program's HLO text: compute, collectives, overlap"
LIMITS: dict = {}
# The text and path flags' kinds (cli/flags.py TEXT_KINDS: what each takes and must refuse).
KINDS = {"--target": "target", "--json": "output file", "--plot": "output file"}
META_SUFFIX = ".meta.json"  # beside a saved program: its target, mesh and device coordinates
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("steptime", help=HELP)
    p.add_argument(
        "program",
        help="optimized HLO text of one compiled program (PROGRAM.meta.json beside it, as "
        "`expertax memory --save-program` writes, gives its target, mesh and devices)",
    )
    p.add_argument(
        "--target",
        help="the hardware it was compiled for: tpu:<slice> or gpu:<chip>x<count> "
        "(default: the one in PROGRAM.meta.json)",
    )
    p.add_argument("--json", help="also write the report as JSON to this path")
    p.add_argument(
        "--plot", help="write the predicted timeline of one layer to this image (.png, .svg, .pdf)"
    )
    add_overwrite_flag(p)
    return p


# What PROGRAM.meta.json may say (`expertax memory --save-program` writes these): key -> (is the
# value of its kind, the kind in words). Other keys are ignored (a note of the user's own, say).
META_KEYS = {
    "target": (lambda v: v is None or isinstance(v, str), "a target such as tpu:v5p-16, or null"),
    "mesh": (
        lambda v: isinstance(v, list) and all(_axis(a) for a in v),
        "a list of [axis name, size] pairs",
    ),
    "devices": (lambda v: _count(v), "a device count (a positive integer)"),
    "coords": (
        lambda v: (
            isinstance(v, list)
            and all(isinstance(c, list) and all(_count(x, 0) for x in c) for c in v)
        ),
        "a list of device coordinates (lists of integers >= 0)",
    ),
    "placement": (lambda v: isinstance(v, str), "text"),
    "model_flops": (lambda v: v is None or _number(v), "a number >= 0, or null"),
    "tokens": (lambda v: v is None or _number(v), "a number >= 0, or null"),
    "model_name": (lambda v: isinstance(v, str), "text"),
}


def _count(v, low: int = 1) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < float("inf")


def _axis(a) -> bool:
    return isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and _count(a[1])


def read_meta(program: str) -> dict:
    """PROGRAM.meta.json beside `program` ({} when there is none), each key of `META_KEYS` of its
    kind; a ConfigError naming the file and the key otherwise."""
    path = Path(program + META_SUFFIX)
    if what_is(path) == "missing":
        return {}
    fix = "save the program again (expertax memory --save-program), or remove it"
    try:
        meta = json.loads(read_text(str(path), path, fix))
    except ValueError as e:
        raise ConfigError(f"{path} is damaged (not JSON: {e}); {fix}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path} is damaged: not a JSON object; {fix}")
    for key, (holds, kind) in META_KEYS.items():
        if key in meta and not holds(meta[key]):
            value = json.dumps(meta[key])
            value = value if len(value) <= 60 else value[:57] + "..."
            raise ConfigError(f"{path}: {key}={value} is not {kind}; {fix}")
    return meta


def check_inputs(args) -> tuple[Any, dict]:
    """The flags, then the program's path, then its PROGRAM.meta.json and the target; before the
    program is read. Returns the target and the meta's values."""
    meta_path = args.program + META_SUFFIX
    outputs = {"--json": args.json, "--plot": args.plot}
    check_apart(outputs, {"PROGRAM": args.program, f"PROGRAM{META_SUFFIX}": meta_path})
    for flag, path in outputs.items():
        check_file(flag, path, args.overwrite)
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
        raise ConfigError(f"--plot={args.plot!r}: the image's suffix is .png, .svg or .pdf")
    if args.target is not None:
        _accelerator(args.target)
    require_file(f"PROGRAM={args.program!r}", args.program, "give an HLO text file")
    meta = read_meta(args.program)
    if args.target is None and not meta.get("target"):
        there = what_is(meta_path) != "missing"
        where = f"{meta_path} names none" if there else f"there is no {meta_path} naming one"
        raise ConfigError(
            f"--target is needed: {where} (give tpu:<slice> or gpu:<chip>x<count>, e.g. "
            "--target tpu:v5p-128)"
        )
    if args.target and meta.get("target") and args.target != meta["target"]:
        raise ConfigError(
            f"--target={args.target} differs from {meta['target']}, the target the program "
            f"was compiled for ({meta_path}); leave --target out"
        )
    spec = args.target or meta["target"]
    t = _accelerator(spec, "--target" if args.target else f"{meta_path}: target")
    _check_devices(t, f"--target={spec}" if args.target else f"its target {spec}", meta, meta_path)
    return t, meta


def _accelerator(spec: str, named: str = "--target"):
    from expertax import targets

    t = targets.parse_target(spec, named)
    if t.is_cpu:
        fix = (
            "give --target tpu:<slice> or gpu:<chip>x<count>"
            if named == "--target"  # a program compiled for the CPU: only a new compile helps
            else "compile it for one (expertax memory --target tpu:<slice> --save-program PATH)"
        )
        raise ConfigError(
            f"{named}={spec}: a step time is predicted for a TPU or GPU target, not the CPU; {fix}"
        )
    return t


def _check_devices(t, target: str, meta: dict, meta_path: str) -> None:
    """The device counts of PROGRAM.meta.json (devices, the mesh's product, the coordinates) are
    those of target `t` (`target`: how the message names it)."""
    mesh = meta.get("mesh")
    said = {
        "devices": (meta.get("devices"), f"devices={meta.get('devices')} says"),
        "mesh": (math.prod(n for _, n in mesh) if mesh else None, f"its mesh {mesh} holds"),
        "coords": (len(meta.get("coords") or []) or None, "its device coordinates place"),
    }
    for n, what in said.values():
        if n is not None and n != t.count:
            raise ConfigError(
                f"{meta_path}: {what} {n} devices, but {target} has {t.count}; give "
                "the target the program was compiled for, or save the program again"
            )


def placement_for(t, meta: dict):
    """Where each device of target `t` sits: the coordinates PROGRAM.meta.json saved, else the
    target's default placement of its mesh."""
    from expertax.steptime import topology

    p = topology.default_placement(t, tuple((a, int(n)) for a, n in meta.get("mesh", [])))
    coords = meta.get("coords")
    if coords:
        import dataclasses

        p = dataclasses.replace(
            p, coords=tuple(tuple(c) for c in coords), source=meta.get("placement", "saved")
        )
    return p


def run(args) -> int:
    from expertax.jsonio import dump
    from expertax.steptime import plot
    from expertax.steptime.report import estimate, format_steptime, json_ready

    t, meta = check_inputs(args)
    placement = placement_for(t, meta)
    host = t.chip.host.link_bytes_per_s if t.chip and t.chip.host else 0.0
    text = Path(args.program).read_text(errors="replace")
    try:
        report = estimate(
            text,
            placement,
            host_bytes_per_s=host,
            model_flops=meta.get("model_flops"),
            tokens=meta.get("tokens"),
            target=t.spec,
        )
    except ValueError as e:
        why = f"PROGRAM={args.program!r} cannot be read as optimized HLO: {e}"
        raise ConfigError(why) from None
    print(format_steptime(report))
    if args.json:
        with open(args.json, "w") as f:
            dump(json_ready(report), f, indent=1)
    if args.plot:
        loop = plot.write(report["_simulator"], args.plot, Path(args.program).name)
        print(f"expertax: wrote the timeline of {loop or 'the step'} to {args.plot}")
    return 0
