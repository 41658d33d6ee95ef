"""`expertax convert from-hf HF_DIR OUT_DIR | to-hf CKPT_DIR OUT_DIR`: HuggingFace checkpoints
(expertax/convert)."""

from __future__ import annotations

import argparse
import sys

from expertax import startup
from expertax.cli import flags
from expertax.outputs import check_apart, check_folder

HELP = (
    "convert checkpoints: expertax convert from-hf HF_DIR OUT_DIR | to-hf CKPT_DIR OUT_DIR "
    "(CKPT_DIR: a from-hf OUT_DIR or a training run folder)"
)
# The numeric flags' valid values (checked before any work: cli/flags.py).
LIMITS = {
    "--workers": flags.count(1, "converting threads"),
    "--max-shard-bytes": flags.count(1, "bytes per safetensors shard"),
}
KINDS: dict[str, str] = {}  # no text or path flags (HF_DIR and OUT_DIR are positional)
# The flags to-hf reads and from-hf does not (given to from-hf: refused), with their defaults.
TO_HF_ONLY = {"--fp8": "fp8", "--max-shard-bytes": "max_shard_bytes"}
DEFAULTS = {"fp8": False, "max_shard_bytes": 5 * 2**30}


def add_parser(sub) -> argparse.ArgumentParser:
    convert = sub.add_parser("convert", help=HELP)
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
        "--max-shard-bytes",
        type=int,
        default=DEFAULTS["max_shard_bytes"],
        help="to-hf: shard size (default 5 GiB)",
    )
    return convert


def run(args) -> int:
    from expertax.config import ConfigError

    src = "HF_DIR" if args.direction == "from-hf" else "CKPT_DIR"
    check_apart({"OUT_DIR": args.dst}, {src: args.src}, around_inputs=True)
    check_folder("OUT_DIR", args.dst, (), overwrite=True)  # a folder that can be written in
    if args.direction == "from-hf":
        for flag, dest in TO_HF_ONLY.items():
            if getattr(args, dest) != DEFAULTS[dest]:
                raise ConfigError(
                    f"{flag} is an option of to-hf: from-hf writes expertax's own format (and "
                    f"reads fp8 as it finds it); leave {flag} out"
                )
    from expertax.convert import convert_from_hf, convert_to_hf

    startup.start_backends()
    try:  # user errors (bad paths, unsupported configs) print one line, like config errors
        if args.direction == "from-hf":
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
