"""`expertax train [PRESET.yml ...] [key=value ...]`; `--help-keys` lists every config key."""

from __future__ import annotations

import argparse
import sys

from expertax import startup
from expertax.cli import flags
from expertax.cli.args import CONFIG_HELP, config_from_args

HELP = "train a model: expertax train [PRESET.yml ...] [key=value ...]"
LIMITS: dict[str, flags.Limit] = {}  # no numeric flags (cli/flags.py)
KINDS: dict[str, str] = {}  # no text or path flags


def add_parser(sub) -> argparse.ArgumentParser:
    train = sub.add_parser("train", help=HELP)
    train.add_argument("config", nargs="*", help=CONFIG_HELP)
    train.add_argument("--help-keys", action="store_true", help="list every config key")
    return train


def help_keys() -> str:
    """Every key by section: the default `expertax train` with no arguments runs (the schema's,
    under the default model_name's preset) and, where the preset changes it, the schema's own
    default; its kind (what changing it changes) and its meaning."""
    from expertax.config.loader import load_fields
    from expertax.config.schema import SECTIONS, key_kind

    runs = load_fields()  # the keys of `expertax train` with no arguments
    preset = runs.model_name
    lines = [
        "Kinds: model (the parameters and what they compute), training (the numbers of later",
        "steps), data (the data stream) - a resumed run must keep these; layout (how the same",
        "numbers are computed) and run (paths, length, logging) may change on resume.",
        f"Defaults: what `expertax train` with no arguments runs, the model_name={preset} preset",
        "over the schema's defaults; where the preset sets a key, the schema's own default (what",
        "another model_name starts from unless its preset sets the key) is named after the kind.",
    ]
    for section in SECTIONS:
        lines.append(f"[{section.__name__.removesuffix('Section').lower()}]")
        for name, field in section.model_fields.items():
            value = getattr(runs, name)
            own = f"; {preset} preset; schema default {field.default!r}"
            own = "" if value == field.default else own
            lines.append(f"  {name} = {value!r} ({key_kind(name)}{own}): {field.description}")
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
