"""`expertax train [PRESET.yml ...] [key=value ...]`; `--help-keys` lists every config key."""

from __future__ import annotations

import argparse
import sys

from expertax import startup
from expertax.cli import flags
from expertax.cli.args import CONFIG_HELP, config_from_args

HELP = "train a model: expertax train [PRESET.yml ...] [key=value ...]"
LIMITS: dict[str, flags.Limit] = {}  # no numeric flags (cli/flags.py)


def add_parser(sub) -> argparse.ArgumentParser:
    train = sub.add_parser("train", help=HELP)
    train.add_argument("config", nargs="*", help=CONFIG_HELP)
    train.add_argument("--help-keys", action="store_true", help="list every config key")
    return train


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


def run(args) -> int:
    if args.help_keys:
        print(help_keys())
        return 0
    cfg = config_from_args(args.config)
    from expertax.preflight import check_paths
    from expertax.train import distributed

    check_paths(cfg)  # before any backend starts

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
