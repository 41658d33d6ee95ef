"""The config key reference, docs/keys.md, generated from the schema: one table per section (key,
type, default, kind, description), read from the same fields, kinds and descriptions that
`expertax train --help-keys` prints.

    python -m expertax.config.keys_doc            # rewrites docs/keys.md (from the repository root)
    python -m expertax.config.keys_doc --check    # exit 1 when docs/keys.md differs

tests/unit/config/test_keys_doc.py fails when the file differs from `render()`.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from expertax.config.keys import KIND_MEANINGS, KINDS
from expertax.config.schema import SECTIONS, Config, key_kind

KEYS_DOC = Path("docs") / "keys.md"
REGENERATE = "python -m expertax.config.keys_doc"

_BOUNDS = (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"))


def section_name(section: type) -> str:
    """`ModelSection` -> "model": the name `--help-keys` prints in brackets."""
    return section.__name__.removesuffix("Section").lower()


def type_text(field: FieldInfo) -> str:
    """A key's type in words: `int ≥ 0`, `float > 0, ≤ 1`, `one of a, b`."""
    annotation: Any = field.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(f"`{v}`" if v != "" else '`""`' for v in annotation.__args__)
    bounds = [
        f"{sign} {getattr(m, attr)}"
        for m in field.metadata
        for attr, sign in _BOUNDS
        if getattr(m, attr, None) is not None
    ]
    name = getattr(annotation, "__name__", str(annotation))
    return name + (" " + ", ".join(bounds) if bounds else "")


def default_text(value: Any) -> str:
    if value == "" and isinstance(value, str):
        return '`""`'
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"`{text}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def key_rows(section: Any) -> Iterator[tuple[str, str, str, str, str]]:
    """(key, type, default, kind, description) of each key of `section`, in schema order."""
    for name, field in section.model_fields.items():
        yield (
            f"`{name}`",
            type_text(field),
            default_text(field.default),
            key_kind(name),
            field.description or "",
        )


def render() -> str:
    """The whole of docs/keys.md."""
    lines = [
        "# Config keys",
        "",
        "Generated from the config schema (`src/expertax/config/`): do not edit by hand; run",
        f"`{REGENERATE}` from the repository root after changing a key.",
        "`expertax train --help-keys` prints the same keys. Set any of them in a YAML preset or",
        "as `key=value` on the command line (docs/usage.md, Training).",
        "",
        "The default column is the schema's: `expertax train` with no arguments runs the",
        f"`model_name={Config.model_fields['model_name'].default}` preset over it, which sets",
        "some keys otherwise (`expertax train --help-keys` shows both).",
        "",
        "A key's kind says what changing it changes. A resumed run must keep its `model`,",
        "`training` and `data` keys; `layout` and `run` keys may change.",
        "",
        "| kind | what it covers |",
        "|---|---|",
        *(f"| `{kind}` | {KIND_MEANINGS[kind]} |" for kind in KINDS),
        "",
        "Sections: "
        + ", ".join(f"[{name}](#{name})" for name in map(section_name, SECTIONS))
        + ".",
    ]
    for section in SECTIONS:
        lines += ["", f"## {section_name(section)}", ""]
        if section.__doc__:
            lines += [_cell(section.__doc__), ""]
        lines += ["| key | type | default | kind | description |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in key_rows(section)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=KEYS_DOC, help="default: %(default)s")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.path.read_text() if args.path.exists() else ""
        if current != text:
            print(f"{args.path} is out of date: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(text)
    print(f"wrote {args.path} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
