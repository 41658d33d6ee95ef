"""Paths the user names, as expertax reads and writes them: what a path is when it is not what a
command needs (a folder where a file goes, a device such as /dev/null), whether a folder can be
written in, and a file's text read as UTF-8. Every refusal is a ConfigError naming the path the
way the command names it (`--prompts-file='p.jsonl'`, `config file 'c.yml'`), what is wrong and
what to give instead.

A leaf module (the standard library and `errors` only): the config loader, the command line and
the tools share it (`outputs.py` builds the output checks on it).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from expertax.errors import ConfigError

# What a path that exists and is neither a regular file nor a folder is (by its `st_mode`).
_SPECIAL = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
)


def what_is(path: str | os.PathLike) -> str:
    """What `path` is, through links: "a file" (a regular one), "a folder", "a character device"
    (/dev/null), "a block device", "a named pipe", "a socket", or "missing" (nothing there, a
    dangling link included)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # ValueError: a NUL byte in the name
        return "missing"
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISDIR(mode):
        return "a folder"
    return next((name for test, name in _SPECIAL if test(mode)), "not a regular file")


def not_a_file(path: str | os.PathLike) -> str | None:
    """None when `path` is a regular file; else why it is not one, as the end of a sentence that
    starts with the path: "does not exist", "is a folder", "is a character device, not a file"."""
    kind = what_is(path)
    if kind == "a file":
        return None
    if kind == "missing":
        return "does not exist"
    if kind == "a folder":
        return "is a folder"
    return f"is {kind}, not a file"


def require_file(label: str, path: str | os.PathLike, fix: str) -> Path:
    """`path` when it is a regular file; else a ConfigError "`label` <why>; `fix`"."""
    why = not_a_file(path)
    if why is not None:
        raise ConfigError(f"{label} {why}; {fix}")
    return Path(path)


def decode(data: bytes, label: str, fix: str) -> str:
    """`data` as UTF-8 text; a ConfigError "`label` is not UTF-8 text (byte 0x.. at offset N);
    `fix`" otherwise (a binary file, another encoding, a file cut inside a character)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{label} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); {fix}"
        ) from None


def read_text(label: str, path: str | os.PathLike, fix: str) -> str:
    """The UTF-8 text of the regular file `path` (`require_file`, `decode`)."""
    return decode(require_file(label, path, fix).read_bytes(), label, fix)


def cannot_write_in(folder: str | os.PathLike) -> str | None:
    """None when a new entry can be made in the existing folder `folder`; else why not (the
    system's words: "Permission denied", "Read-only file system", "No such file or directory"
    for /proc). A folder made and removed at once: what os.access cannot tell (root, /proc,
    read-only mounts)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".expertax-check-", dir=folder))
    except OSError as e:
        return e.strerror or str(e)
    return None


def nearest_existing(path: str | os.PathLike) -> Path:
    """`path` (absolute) or the nearest of its parents that exists."""
    out = Path(path).absolute()
    while not out.exists() and out != out.parent:
        out = out.parent
    return out
