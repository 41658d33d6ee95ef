"""The files a command writes where the user named them (`--json PATH`, `--markdown PATH`,
`expertax report --out DIR`): checked before any work, so that a mistake costs no compile or load.

An output that exists already is refused, naming the flag, the path and the remedy, unless the
command has `--overwrite`: no user file is replaced without being asked. The folder an output
goes into must exist and be a folder. Run folders (`expertax train`, docs/design/runs.md) and
conversions' output folders (docs/design/convert.md) keep their own rules.

A leaf module (the standard library and `errors` only): the command line and the tools'
own parsers (`expertax bench ...`) share it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from expertax.errors import ConfigError

OVERWRITE_FLAG = "--overwrite"


def add_overwrite_flag(parser: argparse.ArgumentParser) -> None:
    """The `--overwrite` flag of a command that writes user-named outputs."""
    parser.add_argument(
        OVERWRITE_FLAG,
        action="store_true",
        help="replace output files that exist already (without it such an output is refused "
        "before any work)",
    )


def _refuse_missing_folder(flag: str, path: str, folder: Path) -> None:
    what = "is not a folder" if folder.exists() else "does not exist"
    raise ConfigError(
        f"{flag}={path!r}: its folder {str(folder)!r} {what}; create it first or give another "
        "path (nothing was done)"
    )


def _refuse_empty(flag: str, path: str, what: str) -> None:
    """An empty value is a mistake, never "not given" nor the current folder."""
    if not path.strip():
        raise ConfigError(f"{flag}={path!r} is empty; give {what}")


def check_file(flag: str, path: str | None, overwrite: bool) -> None:
    """Refuse an output file `path` (given as `flag`; None: not asked for) that cannot be written
    (a folder, or its folder missing) or that exists and `overwrite` is false."""
    if path is None:
        return
    _refuse_empty(flag, path, "a file path")
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{flag}={path!r} is a folder; give a file path")
    folder = out.resolve().parent
    if not folder.is_dir():
        _refuse_missing_folder(flag, path, folder)
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise ConfigError(
            f"{flag}={path!r} exists already: add {OVERWRITE_FLAG} to replace it, or give "
            "another path (nothing was done)"
        )


def check_folder(flag: str, path: str | None, names: Iterable[str], overwrite: bool) -> None:
    """Refuse an output folder `path` (given as `flag`) that is a file, that cannot be created
    (its nearest existing parent not a folder), or that holds any of the files `names` the
    command writes there while `overwrite` is false. A new or unrelated folder is taken."""
    if path is None:
        return
    _refuse_empty(flag, path, "a folder")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag}={path!r} is a file; give a folder (new, or an existing one)")
    if not out.exists():
        parent = next(p for p in out.resolve().parents if p.exists())
        if not parent.is_dir():
            _refuse_missing_folder(flag, path, parent)
        return
    there = sorted(n for n in names if (out / n).exists() or (out / n).is_symlink())
    if there and not overwrite:
        raise ConfigError(
            f"{flag}={path!r} holds {', '.join(there)} already: add {OVERWRITE_FLAG} to replace "
            f"{'it' if len(there) == 1 else 'them'}, or give another folder (nothing was done)"
        )
