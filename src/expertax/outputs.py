"""The files a command writes where the user named them (`--json PATH`, `--markdown PATH`,
`expertax report --out DIR`): checked before any work, so that a mistake costs no compile or load.

An output that exists already is refused, naming the flag, the path and the remedy, unless the
command has `--overwrite`: no user file is replaced without being asked. The folder an output
goes into must exist, be a folder and take new files (a probe: /proc, a read-only mount or a
folder of another user cannot); an existing output must be a regular file (never /dev/null or
another device). `check_apart`: no output on the path of another output of the same command or
of one of its inputs, nor inside a folder it reads, whatever --overwrite says. Run folders
(`expertax train`, docs/design/runs.md) and conversions' output folders (docs/design/convert.md)
keep their own rules.

A leaf module (the standard library, `errors` and `paths`): the command line and the tools' own
parsers (`expertax bench ...`) share it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from expertax.errors import ConfigError
from expertax.paths import cannot_write_in, nearest_existing, what_is

OVERWRITE_FLAG = "--overwrite"
NOTHING_DONE = "(nothing was done)"


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
        f"path {NOTHING_DONE}"
    )


def _refuse_unwritable(flag: str, path: str, folder: Path) -> None:
    """ConfigError when nothing new can be made in the existing folder `folder`."""
    why = cannot_write_in(folder)
    if why is not None:
        raise ConfigError(
            f"{flag}={path!r}: nothing can be written in {str(folder)!r} ({why}); give a path "
            f"in a folder you can write in {NOTHING_DONE}"
        )


def _refuse_empty(flag: str, path: str, what: str) -> None:
    """An empty value is a mistake, never "not given" nor the current folder."""
    if not path.strip():
        raise ConfigError(f"{flag}={path!r} is empty; give {what}")


def check_file(flag: str, path: str | None, overwrite: bool) -> None:
    """Refuse an output file `path` (given as `flag`; None: not asked for) that cannot be written
    (a folder, a device, its folder missing or not writable) or that exists and `overwrite` is
    false."""
    if path is None:
        return
    _refuse_empty(flag, path, "a file path")
    out = Path(path)
    kind = what_is(out)
    if kind == "a folder":
        raise ConfigError(f"{flag}={path!r} is a folder; give a file path")
    if kind not in ("a file", "missing"):
        raise ConfigError(f"{flag}={path!r} is {kind}, not a file; give a file path")
    folder = out.resolve().parent
    if not folder.is_dir():
        _refuse_missing_folder(flag, path, folder)
    _refuse_unwritable(flag, path, folder)
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise ConfigError(
            f"{flag}={path!r} exists already: add {OVERWRITE_FLAG} to replace it, or give "
            f"another path {NOTHING_DONE}"
        )
    if out.exists() and not os.access(out, os.W_OK):
        raise ConfigError(f"{flag}={path!r} cannot be replaced (read-only); give another path")


def check_folder(flag: str, path: str | None, names: Iterable[str], overwrite: bool) -> None:
    """Refuse an output folder `path` (given as `flag`) that is a file or a device, that cannot
    be created or written in (its nearest existing parent not a folder, or not writable), or that
    holds any of the files `names` the command writes there while `overwrite` is false. A new or
    unrelated folder is taken."""
    if path is None:
        return
    _refuse_empty(flag, path, "a folder")
    out = Path(path)
    kind = what_is(out)
    if kind not in ("a folder", "missing"):
        raise ConfigError(f"{flag}={path!r} is {kind}; give a folder (new, or an existing one)")
    if kind == "missing":
        parent = nearest_existing(out.resolve())
        if not parent.is_dir():
            _refuse_missing_folder(flag, path, parent)
        _refuse_unwritable(flag, path, parent)
        return
    _refuse_unwritable(flag, path, out.resolve())
    there = sorted(n for n in names if (out / n).exists() or (out / n).is_symlink())
    if there and not overwrite:
        raise ConfigError(
            f"{flag}={path!r} holds {', '.join(there)} already: add {OVERWRITE_FLAG} to replace "
            f"{'it' if len(there) == 1 else 'them'}, or give another folder {NOTHING_DONE}"
        )


def _same(a: Path, b: Path) -> bool:
    """Whether `a` and `b` (resolved) name one file: the same path, or a hard link of it."""
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def check_apart(
    outputs: Mapping[str, str | None],
    inputs: Mapping[str, str | None] | Iterable[tuple[str, str | None]] = (),
    *,
    around_inputs: bool = False,
    hint: str = "",
) -> None:
    """Refuse, before any work and whatever --overwrite says, an output (`outputs`: how the user
    named it, `--json`, -> its path; None: not asked for) on the path of another output of the
    command (one would replace the other), on the path of one of its `inputs` ((name, path)
    pairs or a mapping, named as the help names them: `PROGRAM` -> path), or inside an input
    that is a folder (a run folder, a checkpoint); with `around_inputs` (an output folder filled
    from scratch), also an output folder holding an input. An input is never written over.
    `hint`: said after the remedy. Empty paths are left to `check_file` / `check_folder`."""
    outs = [(name, p, Path(p).resolve()) for name, p in outputs.items() if p and p.strip()]
    pairs = inputs.items() if isinstance(inputs, Mapping) else inputs
    ins = [(name, p, Path(p).resolve()) for name, p in pairs if p and p.strip()]
    for i, (name, path, real) in enumerate(outs):
        for other, other_path, other_real in outs[:i]:
            if _same(real, other_real):
                raise ConfigError(
                    f"{other}={other_path!r} and {name}={path!r} are the same file: one would "
                    f"replace the other; give each its own path {NOTHING_DONE}"
                )
        for source, source_path, source_real in ins:
            if _same(real, source_real):
                why = (
                    "it never writes over its inputs (with --overwrite neither): give another path"
                )
                where = "is"
            elif source_real in real.parents and source_real.is_dir():
                why, where = (
                    "it writes nothing into its inputs: give a path outside it",
                    "is inside",
                )
            elif around_inputs and real in source_real.parents:
                why, where = "give a folder apart from it", "holds"
            else:
                continue
            raise ConfigError(
                f"{name}={path!r} {where} {source} {source_path!r}, which the command reads; "
                f"{why}{hint} {NOTHING_DONE}"
            )
