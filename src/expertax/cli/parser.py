"""The `expertax` argument parser: one subparser per command, each declared by its own module."""

from __future__ import annotations

import argparse
from types import ModuleType

from expertax import cli
from expertax.cli import bench, convert, generate, memory, parity, report, steptime, train

# name -> the command's module (`HELP`, `add_parser`, `run`), in the order `expertax --help` lists
COMMANDS: dict[str, ModuleType] = {
    "train": train,
    "parity": parity,
    "memory": memory,
    "steptime": steptime,
    "convert": convert,
    "bench": bench,
    "report": report,
    "generate": generate,
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and one parser per subcommand (by name)."""
    description = str(cli.__doc__).splitlines()[0]
    parser = argparse.ArgumentParser(prog="expertax", description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    return parser, {name: module.add_parser(sub) for name, module in COMMANDS.items()}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Flags and `key=value` overrides in any order: each subcommand parses its arguments with
    argparse's intermixed parsing (bench passes everything after its name to the benchmark)."""
    parser, subs = build_parser()
    if not argv or argv[0] not in subs or argv[0] == "bench":
        return parser.parse_args(argv)  # help, errors, and bench's REMAINDER
    args = subs[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args
