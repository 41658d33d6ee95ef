"""Every ContextVar in src/ is listed, with the boundary that forces it, in docs/design/state.md
(and every one listed there exists)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import expertax

SRC = Path(expertax.__file__).parent
DOC = Path(__file__).resolve().parents[2] / "docs" / "design" / "state.md"


def context_vars() -> dict[str, str]:
    """ContextVar name -> the module that creates it."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", "")) == "ContextVar"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                out[node.args[0].value] = str(path.relative_to(SRC))
    return out


def documented() -> dict[str, str]:
    """Name -> its row's justification (the last cell) from the doc's table."""
    rows = re.findall(r"^\| `([\w]+)` \|(.*)\|$", DOC.read_text(), re.M)
    return {name: rest.split("|")[-1].strip() for name, rest in rows}


def test_every_context_var_is_documented_with_its_reason():
    found, doc = context_vars(), documented()
    assert set(found) - set(doc) == set(), f"add a row to {DOC.name} for each"
    assert set(doc) - set(found) == set(), f"rows in {DOC.name} for ContextVars that are gone"
    assert all(len(reason) > 40 for reason in doc.values())


def test_the_scan_finds_context_vars():
    """Negative control: the scan sees the rules table's ContextVar, and a name outside the doc
    would be reported."""
    assert context_vars()["expertax_rules"] == "sharding/rules.py"
    assert "not_a_var" not in documented()
