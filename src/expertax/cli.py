"""`expertax train | memory | parity | bench | convert | report | generate` — the command line.

Positional arguments ending in .yml/.yaml are preset files; `key=value` arguments override keys.
User errors print one line naming the key and value, and exit with status 2.

The `expertax` console command is `command` (pyproject's `[project.scripts]`), in two steps:
1. host memory: the process re-executes itself once with glibc's huge-page tunable set
   (`hostmem.reexec_with_hugepages`; a tunable is read only when a process starts, so this comes
   before anything else is imported: this module's own imports are the standard library's, the
   rest load inside the commands); `EXPERTAX_HUGEPAGES=0` skips it;
2. `main`: parse the arguments and run the subcommand.
`python -m expertax.cli` runs step 2 alone.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from expertax import startup  # the standard library only, like this module

# Only the standard library at import time (see `command`); expertax's modules load in the commands.


def split_args(items: list[str]) -> tuple[list[str], list[str]]:
    from expertax.config import ConfigError

    files = [a for a in items if "=" not in a]
    overrides = [a for a in items if "=" in a]
    for f in files:
        if not f.endswith((".yml", ".yaml")):
            raise ConfigError(f"argument {f!r} is neither a key=value override nor a .yml preset")
    return files, overrides


def config_from_args(items: list[str]):
    from expertax.config import load_config

    files, overrides = split_args(items)
    return load_config(*files, overrides=overrides)


def help_keys() -> str:
    """Every key by section: its default, its kind (what changing it changes) and its meaning."""
    from expertax.config.schema import SECTIONS, key_kind

    lines = [
        "Kinds: model (the parameters and what they compute), training (the numbers of later",
        "steps), data (the data stream) - a resumed run must keep these; layout (how the same",
        "numbers are computed) and run (paths, length, logging) may change on resume.",
    ]
    for section in SECTIONS:
        lines.append(f"[{section.__name__.removesuffix('Section').lower()}]")
        for name, field in section.model_fields.items():
            lines.append(f"  {name} = {field.default!r} ({key_kind(name)}): {field.description}")
    return "\n".join(lines)


def cmd_train(args) -> int:
    if args.help_keys:
        print(help_keys())
        return 0
    cfg = config_from_args(args.config)
    from expertax.train import distributed

    distributed.initialize(cfg)  # before any JAX backend use
    startup.start_backends()
    from expertax.train.loop import train
    from expertax.train.step import NonFiniteError

    try:
        train(cfg)
    except NonFiniteError as e:
        print(f"expertax: error: {e}", file=sys.stderr)
        return 3
    return 0


def cmd_parity(args) -> int:
    from expertax.config import ConfigError

    if args.compile_only:
        return _parity_compile_only(args)
    if args.target is not None:
        raise ConfigError(
            f"--target={args.target} names the hardware a program is compiled for; parity "
            "trains on this machine's devices: add --compile-only to compile for the target"
        )
    cfg = config_from_args(args.config)
    startup.start_backends()
    from expertax.tools.parity.layouts import parse_layout
    from expertax.tools.parity.run import parity_table
    from expertax.tools.parity.table import format_table, write_json

    chosen = [parse_layout(n) for n in args.layouts.split(",")] if args.layouts else None
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


def _parity_compile_only(args) -> int:
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
    target = _target(argparse.Namespace(target=args.target or "cpu"))
    if target.is_cpu:
        _use_simulated_devices(8, args.argv)
    startup.start_backends()
    cfg = config_from_args(args.config)
    from expertax.tools.parity import compile_only as parity_compile
    from expertax.tools.parity.layouts import parse_layout

    on = "cpu" if target.is_cpu else target.platform
    names = args.layouts.split(",") if args.layouts else []
    chosen = [parse_layout(n, backend=on) for n in names] or None
    result = parity_compile.compile_table(
        cfg, target=target, layout_list=chosen, skip_refused=args.skip_refused
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


def cmd_convert(args) -> int:
    from expertax.config import ConfigError
    from expertax.convert import convert_from_hf, convert_to_hf

    startup.start_backends()
    try:  # user errors (bad paths, unsupported configs) print one line, like config errors
        if args.direction == "from-hf":
            if args.fp8:
                raise ValueError("--fp8 is an option of to-hf (from-hf reads fp8 as it finds it)")
            summary = convert_from_hf(args.src, args.dst, workers=args.workers)
            for note in summary.notes:
                print(f"expertax: {note}", file=sys.stderr)
            print(f"expertax: wrote a {summary.config.decoder_block} model to {args.dst}")
        else:
            summary = convert_to_hf(
                args.src,
                args.dst,
                use_fp8=args.fp8,
                workers=args.workers,
                max_shard_bytes=args.max_shard_bytes,
            )
            print(f"expertax: wrote {', '.join(summary.files)} to {args.dst}")
        print(f"expertax: {summary.line()}")
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    return 0


def cmd_bench(args) -> int:
    from expertax.tools import bench_gmm

    benches = {"gmm": bench_gmm.main}
    return benches[args.what](args.rest)


def _use_simulated_devices(n: int, argv: list[str]) -> None:
    """Make JAX see `n` simulated CPU devices: configure them before its backend starts, or
    re-execute this command in a fresh interpreter when a backend already runs with others."""
    import jax

    try:  # JAX refuses this once a backend is initialized
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        if jax.default_backend() == "cpu" and len(jax.devices()) == n:
            return
        import os
        import subprocess

        cmd = [sys.executable, "-m", "expertax.cli", *argv]
        sys.exit(subprocess.call(cmd, env={**os.environ, "JAX_PLATFORMS": "cpu"}))
    jax.config.update("jax_platforms", "cpu")


def cmd_memory(args) -> int:
    import json

    from expertax.config import ConfigError

    target = _target(args)
    cfg = config_from_args(args.config)
    if args.devices is not None:
        if args.devices < 1:
            raise ConfigError(f"--devices={args.devices}: use a positive number of devices")
        _use_simulated_devices(args.devices, args.argv)
    startup.start_backends()
    if args.fit:
        return _memory_fit(cfg, args, target)
    import time

    from expertax.planner import plan
    from expertax.planner.format import format_report, to_json_ready

    t0 = time.perf_counter()
    devices = None if target.is_cpu else target.devices()
    hbm = args.hbm if args.hbm is not None else target.hbm_gib
    try:
        report = plan.compile_report(cfg, devices, hbm_gib=hbm, top=args.top, target=target)
    except ValueError as e:  # e.g. an offload request the backend cannot honour
        raise ConfigError(str(e)) from None
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(format_report(report))
    print(f"(built and compiled abstractly in {report['seconds']} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json_ready(report), f, indent=1)
    return 0


def _target(args):
    """The parsed `--target`; a TPU or GPU target (compiled for, not run on) makes this process
    compile with the CPU as JAX's backend. Refused: a missing compiler, or `--devices` with it."""
    from expertax.config import ConfigError
    from expertax.targets import parse_target, prepare_process

    target = parse_target(args.target)
    if not target.is_cpu:
        if getattr(args, "devices", None) is not None:
            raise ConfigError(
                f"--devices={args.devices} sets the simulated CPU devices of --target=cpu; "
                f"--target={args.target} has {target.count} devices of its own"
            )
        prepare_process(target)
    return target


def _memory_fit(cfg, args, target) -> int:
    """`expertax memory --fit`: the search of planner/fit.py; exit 1 when no candidate fits."""
    import json

    import jax

    from expertax.planner import fit, fit_table

    devices = args.devices if args.devices is not None else len(jax.devices())
    hbm = args.hbm if args.hbm is not None else target.hbm_gib
    result = fit.fit_search(
        cfg,
        target.count or devices,
        hbm,
        headroom=args.headroom,
        allow_drops=args.allow_drops,
        max_compiles=args.max_compiles,
        minutes=args.fit_minutes,
        hardware=None if target.is_cpu else target,
    )
    print(fit_table.format_fit(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fit": result}, f, indent=1)
    return 0 if result["fits"] else 1


def cmd_report(args) -> int:
    from expertax.tools.report import make_report

    result = make_report(args.run_dir, out_dir=args.out, layer=args.layer)
    print(f"expertax: wrote {len(result['plots'])} plots and index.html to {result['out_dir']}")
    return 0


def cmd_generate(args) -> int:
    from expertax.tools.generate import run

    startup.start_backends()
    return run(args)


def _text_prompt(text: str) -> tuple[str, str]:
    return ("text", text)


def _ids_prompt(ids: str) -> tuple[str, str]:
    return ("ids", ids)


COMMANDS: dict[str, tuple[str, Callable]] = {
    "train": ("train a model: expertax train [PRESET.yml ...] [key=value ...]", cmd_train),
    "parity": (
        "every layout vs one device: expertax parity [PRESET.yml ...] [key=value ...]",
        cmd_parity,
    ),
    "memory": ("per-device memory plan of the train step, compiled abstractly", cmd_memory),
    "convert": (
        "convert checkpoints: expertax convert from-hf HF_DIR OUT_DIR | to-hf CKPT_DIR OUT_DIR "
        "(CKPT_DIR: a from-hf OUT_DIR or a training run folder)",
        cmd_convert,
    ),
    "bench": ("benchmarks: expertax bench gmm [--json PATH] [--quick] [--target T] ...", cmd_bench),
    "report": (
        "plots and an index.html of a run folder: expertax report RUN_DIR [--layer I] [--out DIR]",
        cmd_report,
    ),
    "generate": (
        "continue prompts: expertax generate SOURCE --prompt TEXT | --prompt-ids 1,15,27 ... "
        "(SOURCE: a training run folder or a from-hf model directory)",
        cmd_generate,
    ),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and one parser per subcommand (by name)."""
    parser = argparse.ArgumentParser(prog="expertax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help=COMMANDS["train"][0])
    train.add_argument("config", nargs="*", help="PRESET.yml files and key=value overrides")
    train.add_argument("--help-keys", action="store_true", help="list every config key")
    par = sub.add_parser(
        "parity",
        help=COMMANDS["parity"][0],
        description="Train every layout of the matrix (or --layouts) from the same weights and "
        "data and compare its losses with the one-device run's; exit 1 when a layout fails. "
        "The matrix is for 8 devices: on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8"
        " simulates them. --compile-only compiles them for --target and runs nothing. The columns "
        "and the pass rule: README.md, Parity.",
    )
    par.add_argument("config", nargs="*", help="PRESET.yml files and key=value overrides")
    par.add_argument("--steps", type=int, default=None, help="train steps per layout (default 10)")
    par.add_argument("--json", default=None, help="also write the table as JSON to this path")
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
    memory = sub.add_parser("memory", help=COMMANDS["memory"][0])
    memory.add_argument("config", nargs="*", help="PRESET.yml files and key=value overrides")
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
        "--headroom", type=float, default=10.0, help="--fit: percent of --hbm to keep free"
    )
    memory.add_argument(
        "--allow-drops",
        action="store_true",
        help="--fit: also consider candidates that may drop tokens (a capped EP buffer)",
    )
    memory.add_argument(
        "--max-compiles", type=int, default=12, help="--fit: compile at most this many candidates"
    )
    memory.add_argument(
        "--fit-minutes",
        type=float,
        default=30.0,
        help="--fit: start no compile that would end past this many minutes of search",
    )
    convert = sub.add_parser("convert", help=COMMANDS["convert"][0])
    convert.add_argument("direction", choices=("from-hf", "to-hf"))
    convert.add_argument(
        "src",
        help="HF_DIR (from-hf); to-hf: an expertax model directory or a training run folder "
        "(<base_output_directory>/<run_name>; its latest complete checkpoint is exported)",
    )
    convert.add_argument(
        "dst", help="OUT_DIR, new or empty (or an interrupted conversion's: it resumes)"
    )
    convert.add_argument(
        "--fp8",
        action="store_true",
        help="to-hf: linear weights in DeepSeek-V3's fp8 format (e4m3, 128 x 128 block scales)",
    )
    convert.add_argument("--workers", type=int, default=2, help="threads converting (default 2)")
    convert.add_argument(
        "--max-shard-bytes", type=int, default=5 * 2**30, help="to-hf: shard size (default 5 GiB)"
    )
    bench = sub.add_parser("bench", help=COMMANDS["bench"][0])
    bench.add_argument("what", choices=("gmm",), help="which benchmark")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    report = sub.add_parser("report", help=COMMANDS["report"][0])
    report.add_argument(
        "run_dir", help="a training run folder (<base_output_directory>/<run_name>)"
    )
    report.add_argument(
        "--layer", type=int, default=0, help="MoE layer whose expert loads are drawn over steps"
    )
    report.add_argument("--out", default=None, help="output folder (default: RUN_DIR/report)")
    generate = _generate_parser(sub)
    return parser, {
        "train": train,
        "parity": par,
        "memory": memory,
        "convert": convert,
        "bench": bench,
        "report": report,
        "generate": generate,
    }


def _generate_parser(sub) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate",
        help=COMMANDS["generate"][0],
        description="Continue each prompt with the model of SOURCE (greedy at temperature 0) on "
        "all the devices JAX sees; print the continuations and a summary. Checked before "
        "compiling. docs/design/generate.md.",
    )
    gen.add_argument(
        "source",
        help="a training run folder (<base_output_directory>/<run_name>: its latest complete "
        "checkpoint) or an expertax model directory (expertax convert from-hf)",
    )
    gen.add_argument(
        "config",
        nargs="*",
        help="key=value overrides of keys that leave the model as it is: layout keys (mesh "
        "ici_*_parallelism, sharding_rules, attention_impl, ...), dtype, sparse_matmul, "
        "max_target_length",
    )
    gen.add_argument(
        "--prompt",
        dest="prompts",
        action="append",
        type=_text_prompt,
        metavar="TEXT",
        help="a text prompt (repeatable; encoded with the tokenizer, BOS first when it has one)",
    )
    gen.add_argument(
        "--prompt-ids",
        dest="prompts",
        action="append",
        type=_ids_prompt,
        metavar="IDS",
        help="a prompt as token ids, e.g. 1,15,27 (repeatable)",
    )
    gen.add_argument(
        "--prompts-file",
        help='JSON lines, each {"prompt": "text"} or {"ids": [1, 15, 27]} (after the flags\' ones)',
    )
    gen.add_argument("--max-new-tokens", type=int, default=32, help="per prompt (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    gen.add_argument("--json", help="also write prompts, ids, text, log-probs and settings here")
    gen.add_argument(
        "--mla-cache",
        choices=("compressed", "plain"),
        default="compressed",
        help="MLA models: cache the latent (compressed, default) or per-head keys and values",
    )
    gen.add_argument(
        "--speculative",
        action="store_true",
        help="greedy speculative decoding with the model's MTP module drafting one token a step",
    )
    gen.add_argument(
        "--fp8-weights",
        action="store_true",
        help="hold the layers' matrices in fp8 with block scales (half of bfloat16's memory)",
    )
    gen.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompt positions per prefill step (default 512); smaller holds less memory",
    )
    gen.add_argument(
        "--tokenizer",
        help="a tokenizer.json (or its folder), instead of the run's tokenizer_path or the model "
        "directory's tokenizer.json",
    )
    return gen


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Flags and `key=value` overrides in any order: each subcommand parses its arguments with
    argparse's intermixed parsing (bench passes everything after its name to the benchmark)."""
    parser, subs = build_parser()
    if not argv or argv[0] not in subs or argv[0] == "bench":
        return parser.parse_args(argv)  # help, errors, and bench's REMAINDER
    args = subs[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: this process's arguments) and run the subcommand; a user error
    prints one line and returns 2."""
    startup.prepare()  # before anything imports JAX
    from expertax.config import ConfigError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    args.argv = argv
    try:
        return COMMANDS[args.command][1](args)
    except ConfigError as e:
        print(f"expertax: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`expertax train --help-keys | head`)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 1


def command() -> int:
    """The `expertax` console command: step 1, re-execute once with huge pages on (nothing of
    JAX is loaded yet; `EXPERTAX_HUGEPAGES=0`: as it is); step 2, `main`."""
    from expertax import hostmem

    hostmem.reexec_with_hugepages([sys.executable, "-m", "expertax.cli", *sys.argv[1:]])
    return main()


if __name__ == "__main__":
    sys.exit(main())
