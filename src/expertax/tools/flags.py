"""Comma-list flags of the tools' own command lines (`expertax bench ...`), read into values or a
ConfigError that names the flag."""

from __future__ import annotations

from expertax.errors import ConfigError


def positive_ints(flag: str, text: str, sep: str = ",") -> list[int]:
    """`text` (`8,64` with `sep=","`, `512x1024` with `sep="x"`) as positive integers."""
    try:
        values = [int(v) for v in text.split(sep)]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"{flag}={text!r}: use positive integers separated by {sep!r}")
    return values


def choices(flag: str, text: str, valid: tuple[str, ...]) -> list[str]:
    """`text`, a comma list, each of whose items is one of `valid`."""
    values = text.split(",")
    for v in values:
        if v not in valid:
            raise ConfigError(f"{flag}={text!r}: {v!r} is not one of {', '.join(valid)}")
    return values
