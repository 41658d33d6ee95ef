"""What the commands' flags take, as data, so that every flag has values it must refuse.

- numeric flags: each command module's `LIMITS` maps a flag (`--hbm`) to its `Limit`, and `check`
  refuses a value outside it (inf and nan included) with one line naming the flag, the value and
  the valid range, before the command does any work;
- text and path flags: each command module's `KINDS` (and the benchmarks' own parsers' `KINDS`,
  tools/bench_gmm*.py) maps a flag to its kind, a key of `TEXT_KINDS`: what a value is, and values
  that must be refused (a missing file, a folder where a file goes, a malformed list, ...);
- flags with argparse `choices` refuse other values themselves, and a flag without a value
  (`store_true`) has none to refuse.
`tests/smoke/test_bad_flags.py` walks every parser: it fails while a flag has neither a limit, a
kind, choices nor the `store_true` rule, and runs each kind's bad values through the command."""

from __future__ import annotations

import argparse
import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Limit:
    """Valid values: finite, `low` <= value (< when `low_open`), value <= `high` (< when
    `high_open`); `what` says what the flag counts."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    integer: bool = False  # the flag's argparse type is int (else float)
    what: str = ""

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if math.isinf(self.high):
            return f"{kind} {'>' if self.low_open else '>='} {_num(self.low)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{kind} in {left}{_num(self.low)}, {_num(self.high)}{right}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def count(low: int, what: str) -> Limit:
    """An integer flag of at least `low`."""
    return Limit(low, integer=True, what=what)


def above(low: float, what: str) -> Limit:
    """A number flag greater than `low`."""
    return Limit(low, low_open=True, what=what)


def dest(flag: str) -> str:
    """argparse's attribute for `flag` (`--max-new-tokens` -> `max_new_tokens`)."""
    return flag.lstrip("-").replace("-", "_")


def check(args: argparse.Namespace, limits: dict[str, Limit]) -> None:
    """ConfigError for the first flag of `limits` (by name, `--hbm`) whose value in `args` is
    outside its limit."""
    from expertax.errors import ConfigError

    for flag, limit in limits.items():
        value = getattr(args, dest(flag), None)
        if value is None or limit.holds(value):
            continue
        what = f" ({limit.what})" if limit.what else ""
        raise ConfigError(f"{flag}={value}: use {limit.describe()}{what}")


@dataclasses.dataclass(frozen=True)
class TextKind:
    """What a text or path flag takes (`what`), and values of it that must be refused (`bad`),
    with placeholders the smoke test fills in: {missing} a path that does not exist, {folder} an
    existing folder, {file} an existing file, {not_json} an existing file that is not JSON,
    {not_utf8} an existing file that is not UTF-8 text, {device} a device (/dev/null), {locked}
    a path in a folder nothing can be written in (/proc). An empty value is refused by every kind
    that has bad values (it is never "not given")."""

    what: str
    bad: tuple[str, ...]


TEXT_KINDS: dict[str, TextKind] = {
    "free text": TextKind("any text (a prompt): no value is malformed", ()),
    "input json": TextKind(
        "an existing JSON (or JSON lines) file",
        ("", "{missing}", "{folder}", "{not_json}", "{not_utf8}", "{device}"),
    ),
    "input json list": TextKind(
        "a comma list of existing JSON files",
        ("", "{missing}", "{folder}", "{not_json}", "{not_utf8}", "{device}", "{file},,{file}"),
    ),
    "tokenizer": TextKind(
        "a tokenizer.json file or a folder holding one",
        ("", "{missing}", "{folder}", "{not_json}", "{device}"),
    ),
    "output file": TextKind(
        "a regular file to write, in an existing folder that takes new files; one that exists only "
        "with --overwrite",
        ("", "{missing}/out.json", "{folder}", "{file}", "{file}/out.json", "{device}")
        + ("{locked}/out.json",),
    ),
    "output folder": TextKind(
        "a folder to write into, new or existing, where new files can be made",
        ("", "{file}", "{file}/sub", "{device}", "{locked}/out"),
    ),
    "target": TextKind(
        "cpu, tpu:<chip>-<N> or gpu:<chip>x<N>", ("", "tpu:v9-8", "gpu:h100x12", "h100", "cpu:4")
    ),
    "parity layouts": TextKind(
        "a comma list of parity layouts (sparse-ring-ep8, dense-ep2-tp2-data2, ...)",
        ("", "sparse-bogus-ep2", "sparse-ring-ep8,,dense-ep2"),
    ),
    "token ids": TextKind(
        "comma-separated non-negative integer token ids below the vocab size",
        ("", "1,,2", "1,x", "-1", "1,2,"),
    ),
    "positive ints": TextKind("a comma list of positive integers", ("", "0", "4k", "8,,64")),
    "shapes": TextKind("a comma list of DxF", ("", "512x", "512x1024x2", "0x8", "512x1024,")),
    "shape": TextKind("one DxF", ("", "512x", "512x1024x2", "0x8", "512x1024,1024x512")),
    "gmm backends": TextKind(
        "a comma list of grouped-matmul backends that run on the platform",
        ("", "tiled,cublas", "megablox", "tiled,,ragged_dot"),
    ),
    "choice list": TextKind("a comma list of the flag's choices", ("", "no-such-choice", "fwd,")),
}
