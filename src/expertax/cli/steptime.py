"""`expertax steptime PROGRAM --target T`: the step time predicted from a compiled program's
optimized HLO text (expertax's, saved by `expertax memory --save-program`, or any JAX
program's `jit(f).lower(...).compile().as_text()`), with its parts (expertax/steptime/)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from expertax.errors import ConfigError
from expertax.outputs import add_overwrite_flag, check_file

HELP = "step time predicted from a compiled program's HLO text: compute, collectives, overlap"
LIMITS: dict = {}
# The text and path flags' kinds (cli/flags.py TEXT_KINDS: what each takes and must refuse).
KINDS = {"--target": "target", "--json": "output file", "--plot": "output file"}
META_SUFFIX = ".meta.json"  # beside a saved program: its target, mesh and device coordinates


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
        "--plot", help="write the predicted timeline of one layer to this image (.png, .svg)"
    )
    add_overwrite_flag(p)
    return p


def read_meta(program: str) -> dict:
    path = Path(program + META_SUFFIX)
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is damaged (not JSON: {e}); remove it or save again") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path} is damaged: not a JSON object; remove it or save again")
    return meta


def check_inputs(args) -> tuple[str, dict]:
    """The flags, then the program's path, then the target; before anything is read."""
    for flag in ("--json", "--plot"):
        check_file(flag, getattr(args, flag[2:]), args.overwrite)
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"--plot={args.plot!r}: the image's suffix is .png, .svg or .pdf")
    if args.target is not None:
        _accelerator(args.target)
    program = Path(args.program)
    if not program.exists():
        raise ConfigError(f"PROGRAM={args.program!r} does not exist; give an HLO text file")
    if not program.is_file():
        raise ConfigError(f"PROGRAM={args.program!r} is a folder; give an HLO text file")
    meta = read_meta(args.program)
    target = args.target or meta.get("target")
    if not target:
        raise ConfigError(
            "--target is needed: the program has no PROGRAM.meta.json naming one "
            "(give tpu:<slice> or gpu:<chip>x<count>, e.g. --target tpu:v5p-128)"
        )
    if args.target and meta.get("target") and args.target != meta["target"]:
        raise ConfigError(
            f"--target={args.target} differs from {meta['target']}, the target the program "
            f"was compiled for ({args.program}{META_SUFFIX}); leave --target out"
        )
    return target, meta


def _accelerator(spec: str):
    from expertax import targets

    t = targets.parse_target(spec)
    if t.is_cpu:
        raise ConfigError(
            f"--target={spec}: a step time is predicted for a TPU or GPU target, not "
            "the CPU; give tpu:<slice> or gpu:<chip>x<count>"
        )
    return t


def placement_for(target_spec: str, meta: dict):
    from expertax.steptime import topology

    t = _accelerator(target_spec)
    p = topology.default_placement(t, tuple((a, int(n)) for a, n in meta.get("mesh", [])))
    coords = meta.get("coords")
    if coords:
        if len(coords) != t.count:
            raise ConfigError(
                f"{META_SUFFIX}: {len(coords)} device coordinates for {t.count} devices of "
                f"{target_spec}; save the program again"
            )
        import dataclasses

        p = dataclasses.replace(
            p, coords=tuple(tuple(c) for c in coords), source=meta.get("placement", "saved")
        )
    return t, p


def run(args) -> int:
    from expertax.jsonio import dump
    from expertax.steptime import plot
    from expertax.steptime.report import estimate, format_steptime, json_ready

    target_spec, meta = check_inputs(args)
    t, placement = placement_for(target_spec, meta)
    host = t.chip.host.link_bytes_per_s if t.chip and t.chip.host else 0.0
    text = Path(args.program).read_text(errors="replace")
    try:
        report = estimate(
            text,
            placement,
            host_bytes_per_s=host,
            model_flops=meta.get("model_flops"),
            tokens=meta.get("tokens"),
            target=target_spec,
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
