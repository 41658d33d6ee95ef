"""The valid ranges of the commands' numeric flags, as data: each command module's `LIMITS`
maps a flag (`--hbm`) to its `Limit`, and `check` refuses a value outside it (inf and nan included)
with one line naming the flag, the value and the valid range, before the command does any work.
`tests/smoke/test_bad_flags.py` fails while a numeric flag has no limit."""

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
