"""`expertax parity`: every layout against one device (tools/parity/), or with `--compile-only`
every layout compiled for `--target` (tools/parity/compile_only.py)."""

from __future__ import annotations

import argparse
import sys

from expertax import startup
from expertax.cli import flags
from expertax.cli.args import CONFIG_HELP, config_from_args, split_args
from expertax.cli.devices import target, use_simulated_devices
from expertax.outputs import add_overwrite_flag, check_apart, check_file

HELP = "every layout vs one device: expertax parity [PRESET.yml ...] [key=value ...]"
# The numeric flags' valid values (checked before any work: cli/flags.py).
LIMITS = {"--steps": flags.count(1, "train steps per layout")}
# The text and path flags' kinds (cli/flags.py TEXT_KINDS: what each takes and must refuse).
KINDS = {"--json": "output file", "--layouts": "parity layouts", "--target": "target"}


def add_parser(sub) -> argparse.ArgumentParser:
    par = sub.add_parser(
        "parity",
        help=HELP,
        description="Train every layout of the matrix (or --layouts) from the same weights and "
        "data and compare its losses with the one-device run's; exit 1 when a layout fails. "
        "The matrix is for 8 devices: on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8"
        " simulates them. --compile-only compiles them for --target and runs nothing. The columns "
        "and the pass rule: README.md, Parity.",
    )
    par.add_argument("config", nargs="*", help=CONFIG_HELP)
    par.add_argument("--steps", type=int, default=None, help="train steps per layout (default 10)")
    par.add_argument("--json", default=None, help="also write the table as JSON to this path")
    add_overwrite_flag(par)
    par.add_argument(
        "--layouts",
        default=None,
        help="comma-separated subset, e.g. sparse-ring-ep8,dense-ep2-tp2-data2,"
        "sparse-ring-pp2-ep2-fsdp2 (ppN stages, mbM microbatches, rR repeats)",
    )
    par.add_argument(
        "--skip-refused",
        action="store_true",
        help="list layouts the config checks refuse as skipped instead of failing the table",
    )
    par.add_argument(
        "--packed",
        action="store_true",
        help="train on packed data: each sequence cut into up to three documents (segment ids, "
        "positions from 0 per document)",
    )
    par.add_argument(
        "--impose-routing",
        action="store_true",
        help="also compare each layout's first-step loss with the reference's routing imposed "
        "(its expert choices per token and slot, per layer): the numerics without routing flips",
    )
    par.add_argument(
        "--compile-only",
        action="store_true",
        help="compile every layout for --target and run nothing: per layout whether it "
        "compiles, its peak memory per device, compiled/model FLOPs, the MoE exchange found "
        "(ragged or padded all-to-all) and the program's collectives and kernels",
    )
    par.add_argument(
        "--target",
        default=None,
        help="--compile-only: the hardware to compile for, as expertax memory's --target "
        "(cpu: 8 simulated devices, the default; tpu:v5p-16; gpu:h100x8)",
    )
    return par


def _refuse_run_keys(overrides: list[str]) -> None:
    """A run key given as key=value (the steps, the output folder, checkpoints, logging): parity
    trains no run of its own, so it would do nothing. Refused, naming the key (a preset file's
    run keys are taken and left unread, so that a training preset serves as it is)."""
    from expertax.config import ConfigError
    from expertax.config.loader import parse_overrides
    from expertax.config.schema import RUN, Config, key_kind

    for key, value in parse_overrides(overrides).items():
        if key in Config.model_fields and key_kind(key) == RUN and key != "model_name":
            hint = "give --steps N" if key == "steps" else f"leave {key} out"
            raise ConfigError(
                f"{key}={value!r} is a run key, which parity does not read (it trains each layout "
                f"--steps steps from the same weights and writes no run folder); {hint}"
            )


def _layout_names(text: str) -> list[str]:
    """The names of a --layouts list; an empty entry is refused naming the value given."""
    from expertax.config import ConfigError

    names = text.split(",")
    for i, name in enumerate(names, start=1):
        if not name.strip():
            raise ConfigError(
                f"--layouts={text!r}: entry {i} is empty; give a comma list of layouts, e.g. "
                "sparse-ring-ep8,dense-ep2-tp2-data2"
            )
    return names


def run(args) -> int:
    files, overrides = split_args(args.config)
    check_apart({"--json": args.json}, [("the config file", f) for f in files])
    check_file("--json", args.json, args.overwrite)  # before the config (and JAX) loads
    if args.layouts is not None:
        _layout_names(args.layouts)
    _refuse_run_keys(overrides)
    from expertax.config import ConfigError

    if args.compile_only:
        return _compile_only(args)
    if args.target is not None:
        from expertax.targets import parse_target

        parse_target(args.target)  # a malformed one named as such first
        raise ConfigError(
            f"--target={args.target} names the hardware a program is compiled for; parity "
            "trains on this machine's devices: add --compile-only to compile for the target"
        )
    cfg = config_from_args(args.config)
    startup.start_backends()
    from expertax.tools.parity.layouts import parse_layout
    from expertax.tools.parity.run import parity_table
    from expertax.tools.parity.table import format_table, write_json

    given = args.layouts is not None  # an empty --layouts is refused, not the whole matrix
    chosen = [parse_layout(n) for n in _layout_names(args.layouts)] if given else None
    result = parity_table(
        cfg,
        steps=10 if args.steps is None else args.steps,
        layout_list=chosen,
        skip_refused=args.skip_refused,
        impose_routing=args.impose_routing,
        packed=args.packed,
    )
    print(format_table(result))
    if args.json:
        write_json(result, args.json)
    if not result["ok"]:
        refused = "" if args.skip_refused else f", {len(result.get('refused', []))} refused"
        print(
            f"expertax: parity FAILED ({len(result['rows'])} layouts compared{refused}, relative "
            f"tolerance {result['tolerance']})",
            file=sys.stderr,
        )
    return 0 if result["ok"] else 1


def _compile_only(args) -> int:
    """`expertax parity --compile-only`: compile every layout for `--target` (default: 8
    simulated CPU devices), run nothing (tools/parity/compile_only.py); exit 1 when one fails."""
    from expertax.config import ConfigError

    given = {"--steps": args.steps is not None, "--impose-routing": args.impose_routing}
    cannot = [flag for flag, on in given.items() if on]
    if cannot:
        raise ConfigError(
            f"{' and '.join(cannot)} cannot be honoured with --compile-only, which runs no step "
            "(nothing trains, no loss to compare); drop them, or drop --compile-only"
        )
    hardware = target("cpu" if args.target is None else args.target)
    if hardware.is_cpu:
        use_simulated_devices(8, args.argv)
    startup.start_backends()
    cfg = config_from_args(args.config)
    from expertax.tools.parity import compile_only as parity_compile
    from expertax.tools.parity.layouts import parse_layout

    on = "cpu" if hardware.is_cpu else hardware.platform
    names = _layout_names(args.layouts) if args.layouts is not None else []
    chosen = [parse_layout(n, backend=on) for n in names] or None
    result = parity_compile.compile_table(
        cfg, target=hardware, layout_list=chosen, skip_refused=args.skip_refused
    )
    print(parity_compile.format_table(result))
    if args.json:
        parity_compile.write_json(result, args.json)
    if not result["ok"]:
        failed = [r["layout"] for r in result["rows"] if not r["ok"]]
        refused = "" if args.skip_refused else f", {len(result['refused'])} refused"
        print(
            f"expertax: parity --compile-only FAILED for {result['target']} "
            f"({len(result['rows'])} layouts compiled or tried, {len(failed)} failed{refused}"
            + (f": {', '.join(failed)}" if failed else "")
            + ")",
            file=sys.stderr,
        )
    return 0 if result["ok"] else 1
