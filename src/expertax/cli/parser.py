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
    args = subs[argv[0]].parse_intermixed_args(attach_dash_values(subs[argv[0]], argv[1:]))
    args.command = argv[0]
    return args


def attach_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--flag -1,2` as `--flag=-1,2`: argparse takes a word starting with "-" for another flag
    unless it reads as a negative number, and would answer "expected one argument"; a flag that
    takes one value followed by a word that is not one of the parser's flags gets that word as
    its value (refused or taken by the flag's own check: `--prompt-ids -1,2` names the -1)."""
    one_value = {
        s for a in parser._actions if a.option_strings and a.nargs is None for s in a.option_strings
    }
    known = {s for a in parser._actions for s in a.option_strings}
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) else ""
        dashed = value.startswith("-") and value != "--" and value.split("=")[0] not in known
        if word in one_value and dashed:
            out.append(f"{word}={value}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out
