"""`expertax memory`: the per-device memory plan of the train step, compiled abstractly
(planner/plan.py), or with `--fit` the search for a step that fits (planner/fit.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from expertax import startup
from expertax.cli import flags
from expertax.cli.args import CONFIG_HELP, config_from_args, split_args
from expertax.cli.devices import target, use_simulated_devices
from expertax.errors import ConfigError
from expertax.outputs import add_overwrite_flag, check_apart, check_file

HELP = "per-device memory plan of the train step, compiled abstractly"
# The numeric flags' valid values (checked before any work: cli/flags.py).
LIMITS = {
    "--devices": flags.count(1, "simulated CPU devices"),
    "--hbm": flags.above(0, "device memory in GiB"),
    "--top": flags.count(0, "buffers listed; 0: none"),
    "--headroom": flags.Limit(0, 100, high_open=True, what="percent of --hbm kept free"),
    "--max-compiles": flags.count(1, "candidates compiled"),
    "--fit-minutes": flags.above(0, "minutes of search"),
}
# The text and path flags' kinds (cli/flags.py TEXT_KINDS: what each takes and must refuse).
KINDS = {
    "--target": "target",
    "--json": "output file",
    "--save-program": "output file",
    "--plot": "output file",
}


def add_parser(sub) -> argparse.ArgumentParser:
    memory = sub.add_parser("memory", help=HELP)
    memory.add_argument("config", nargs="*", help=CONFIG_HELP)
    memory.add_argument(
        "--target",
        default="cpu",
        help="the hardware to compile for: cpu (default; --devices N simulates N), "
        "tpu:<slice> (tpu:v5p-16, tpu:v5p-1024, tpu:v6e-256, tpu:v5e-256; needs expertax[tpu]) "
        "or gpu:<chip>x<count> (gpu:h100x8, gpu:h200x128; needs expertax[gpu]); the chip's "
        "memory is the default --hbm",
    )
    memory.add_argument("--devices", type=int, help="compile for N simulated CPU devices")
    memory.add_argument("--json", help="also write the report as JSON to this path")
    memory.add_argument(
        "--save-program",
        help="write the compiled step's optimized HLO text to this path (and its target, mesh "
        "and devices beside it, PATH.meta.json) for `expertax steptime`",
    )
    memory.add_argument(
        "--plot",
        help="TPU or GPU target: write the predicted timeline of one layer to this image "
        "(.png, .svg, .pdf)",
    )
    add_overwrite_flag(memory)
    memory.add_argument(
        "--hbm", type=float, help="device memory budget in GiB (default: the target chip's)"
    )
    memory.add_argument(
        "--top",
        type=int,
        default=15,
        help="list the N largest buffers alive at XLA's peak, with their source (0: none)",
    )
    memory.add_argument(
        "--fit",
        action="store_true",
        help="search layouts, token chunks, remat, rules and offload for a step that fits --hbm "
        "on --devices (ranked table, the best as a train line; exit 1 when none fits)",
    )
    memory.add_argument(
        "--headroom",
        type=float,
        default=FIT_ONLY["headroom"],
        help="--fit: percent of --hbm to keep free",
    )
    memory.add_argument(
        "--allow-drops",
        action="store_true",
        help="--fit: also consider candidates that may drop tokens (a capped EP buffer)",
    )
    memory.add_argument(
        "--max-compiles",
        type=int,
        default=FIT_ONLY["max_compiles"],
        help="--fit: compile at most this many candidates",
    )
    memory.add_argument(
        "--fit-minutes",
        type=float,
        default=FIT_ONLY["fit_minutes"],
        help="--fit: start no compile that would end past this many minutes of search",
    )
    return memory


META_SUFFIX = ".meta.json"  # beside --save-program (steptime/program.py)
# The flags that only the fit search reads, with their defaults (set without --fit: refused).
FIT_ONLY = {"headroom": 10.0, "allow_drops": False, "max_compiles": 12, "fit_minutes": 30.0}


def run(args) -> int:
    meta = args.save_program + META_SUFFIX if args.save_program else None
    outputs = {
        "--json": args.json,
        "--save-program": args.save_program,
        f"--save-program's {META_SUFFIX}": meta,
        "--plot": args.plot,
    }
    files, _ = split_args(args.config)
    check_apart(outputs, [("the config file", f) for f in files])
    for flag, path in outputs.items():  # before the config (and JAX) loads
        check_file(flag.split("'")[0], path, args.overwrite)
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"--plot={args.plot!r}: the image's suffix is .png, .svg or .pdf")
    from expertax.jsonio import dump

    if args.fit and (args.save_program or args.plot):
        flag = "--save-program" if args.save_program else "--plot"
        raise ConfigError(f"{flag} writes one compiled program's files; leave out --fit or {flag}")
    if not args.fit:
        for name, default in FIT_ONLY.items():
            if getattr(args, name) != default:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(
                    f"{flag}={getattr(args, name)} is read by the fit search only; add --fit, or "
                    f"leave {flag} out"
                )

    hardware = target(args.target, args.devices)
    if args.plot and hardware.is_cpu:
        raise ConfigError(
            f"--plot={args.plot!r}: the timeline is of the step time predicted for a TPU or GPU "
            f"target, not --target={args.target}; add --target tpu:<slice> or "
            "gpu:<chip>x<count>, or leave --plot out"
        )
    cfg = config_from_args(args.config)
    if args.devices is not None:
        use_simulated_devices(args.devices, args.argv)
    startup.start_backends()
    if args.fit:
        return _fit(cfg, args, hardware)
    import time

    from expertax.planner import plan
    from expertax.planner.format import format_report, to_json_ready

    t0 = time.perf_counter()
    devices = None if hardware.is_cpu else hardware.devices()
    hbm = args.hbm if args.hbm is not None else hardware.hbm_gib
    try:
        report = plan.compile_report(
            cfg, devices, hbm_gib=hbm, top=args.top, target=hardware, save_program=args.save_program
        )
    except ValueError as e:  # e.g. an offload request the backend cannot honour
        raise ConfigError(str(e)) from None
    report["seconds"] = round(time.perf_counter() - t0, 1)
    simulator = report.pop("_steptime", None)
    print(format_report(report))
    print(f"(built and compiled abstractly in {report['seconds']} s)")
    if args.save_program:
        print(f"expertax: wrote the program to {args.save_program} (+ .meta.json)")
    if args.plot and simulator is not None:  # a TPU or GPU target (checked above)
        from expertax.steptime import plot

        plot.write(simulator, args.plot, f"{cfg.model_name} on {hardware.spec}")
        print(f"expertax: wrote the predicted timeline of one layer to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            dump(to_json_ready(report), f, indent=1)
    return 0


def _fit(cfg, args, hardware) -> int:
    """`expertax memory --fit`: the search of planner/fit.py; exit 1 when no candidate fits."""
    import jax

    from expertax.jsonio import dump
    from expertax.planner import fit, fit_table

    devices = args.devices if args.devices is not None else len(jax.devices())
    hbm = args.hbm if args.hbm is not None else hardware.hbm_gib
    result = fit.fit_search(
        cfg,
        hardware.count or devices,
        hbm,
        headroom=args.headroom,
        allow_drops=args.allow_drops,
        max_compiles=args.max_compiles,
        minutes=args.fit_minutes,
        hardware=None if hardware.is_cpu else hardware,
    )
    print(fit_table.format_fit(result))
    if args.json:
        with open(args.json, "w") as f:
            dump({"fit": result}, f, indent=1)
    return 0 if result["fits"] else 1
