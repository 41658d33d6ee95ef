"""Comma-list flags of the tools' own command lines (`expertax bench ...`), read into values or a
ConfigError that names the flag, the value and what is valid."""

from __future__ import annotations

import argparse
import json
from typing import Any

from expertax.errors import ConfigError
from expertax.paths import read_text


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


def token_ids(flag: str, text: str, vocab_size: int | None = None) -> list[int]:
    """`text` (`1,15,27`; spaces also separate) as token ids: ConfigError naming `flag`, the value
    and what is valid for an empty entry (`1,,2`), an entry that is not a non-negative integer, or
    (given `vocab_size`) an id not below the vocabulary size."""
    below = f"below the vocab size ({vocab_size})" if vocab_size else "below the vocab size"
    valid = f"comma-separated non-negative integer token ids {below}, e.g. 1,15,27"
    ids: list[int] = []
    for n, item in enumerate(text.split(","), start=1):
        words = item.split()
        if not words:
            raise ConfigError(f"{flag}={text!r}: entry {n} is empty; use {valid}")
        for word in words:
            if not (word.isascii() and word.isdigit()):
                raise ConfigError(
                    f"{flag}={text!r}: {word!r} is not a non-negative integer; use {valid}"
                )
            ids.append(int(word))
    too_big = [i for i in ids if vocab_size is not None and i >= vocab_size]
    if too_big:
        raise ConfigError(f"{flag}={text!r}: {too_big[0]} is not {below}; use {valid}")
    return ids


def gmm_backends(flag: str, text: str, valid: tuple[str, ...], on: str) -> list[str]:
    """`text`, a comma list of grouped-matmul backends of `valid`, each of which runs on platform
    `on` with its package installed (nn/moe/gmm_kernels.py); ConfigError naming `flag`, the
    value and the backends valid on `on` otherwise."""
    from expertax.nn.moe import gmm_kernels

    values = choices(flag, text, valid)
    here = [b for b in valid if b not in gmm_kernels.KERNELS or b in gmm_kernels.kernels_on(on)]
    for b in values:
        if b not in here:
            runs_on = "/".join(gmm_kernels.KERNELS[b][0])
            raise ConfigError(
                f"{flag}={text!r}: {b}'s kernels run on {runs_on}, not on {on}; "
                f"valid on {on}: {', '.join(here)}"
            )
        missing = gmm_kernels.missing_package(b)
        if missing:
            raise ConfigError(f"{flag}={text!r}: {b} {missing}")
    return values


def saved_json(flag: str, path: str, keys: dict[str, tuple[str, ...]], fix: str) -> dict[str, Any]:
    """The JSON object of file `path` (given as `flag`) that an earlier run of the tool wrote:
    `keys` maps its list of rows (`"rows"`) and its machine object (`"machine"`) to the keys each
    holds. ConfigError naming the flag, the file and `fix` (what to give instead) when the file is
    missing, a folder, not JSON, or another document."""
    where = f"{flag}={path!r}"
    text = read_text(where, path, fix)  # a missing file, a folder, a device, not UTF-8: named
    try:
        saved = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{where} is not JSON ({e}); {fix}") from None
    rows = saved.get("rows") if isinstance(saved, dict) else None
    machine = saved.get("machine") if isinstance(saved, dict) else None
    if (
        not isinstance(rows, list)
        or not isinstance(machine, dict)
        or any(not isinstance(r, dict) or any(k not in r for k in keys["rows"]) for r in rows)
        or any(k not in machine for k in keys["machine"])
    ):
        raise ConfigError(
            f'{where} is not this benchmark\'s output (a "machine" object and "rows" with '
            f"{', '.join(keys['rows'])}); {fix}"
        )
    return saved


def unread_with(mode: str, parser: argparse.ArgumentParser, args, flags: tuple[str, ...]) -> None:
    """ConfigError for the first of `flags` given a value other than its default while `mode`
    (a flag) is on, in which it is not read: a flag that does nothing is a mistake, not a
    setting (like memory's fit-only flags without --fit)."""
    for flag in flags:
        dest = flag.lstrip("-").replace("-", "_")
        value = getattr(args, dest)
        if value != parser.get_default(dest):
            given = flag if value is True else f"{flag}={value}"
            raise ConfigError(
                f"{given} is not read with {mode} (nothing is measured or compiled); leave "
                f"{flag} out, or {mode} out"
            )
