"""The nn <-> planner contract of named scopes (`expertax/scopes.py`): every scope the planner or
the tools read has a writer in nn and every one nn writes has a reader; no scope is spelled out
anywhere else; a written label is found by its reader's pattern."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import expertax
from expertax import scopes

SRC = Path(expertax.__file__).parent
SCOPES = [n for n in dir(scopes) if n.isupper() and not n.startswith("_") and n != "PRODUCTS"]
READERS = ("planner/", "tools/", "fp8/compiled.py", "steptime/")


def uses() -> dict[str, set[str]]:
    """Scope name -> the modules (relative to src/expertax) that name `scopes.<NAME>`."""
    out: dict[str, set[str]] = {n: set() for n in SCOPES}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "scopes"
                and node.attr in out
            ):
                out[node.attr].add(str(path.relative_to(SRC)))
    return out


def spelled_out() -> list[str]:
    """String constants outside scopes.py (docstrings aside) that spell a scope's name."""
    texts = [s.prefix + "~" for s in (scopes.TRIPS, scopes.ROWS, scopes.FP8_TILE, scopes.IDLE)]
    names = set(scopes.FP8_DENSE + scopes.FP8_GROUPED)
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "scopes.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef)
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) in docstrings:
                    continue
                if node.value in names or any(t in node.value for t in texts):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value!r}")
    return found


@pytest.mark.parametrize("name", SCOPES)
def test_every_scope_has_a_writer_in_nn_and_a_reader(name):
    where = uses()[name]
    writers = [m for m in where if not m.startswith(READERS)]
    readers = [m for m in where if m.startswith(READERS)]
    assert writers, f"scopes.{name} is read by {readers} but nothing writes it"
    assert readers, f"scopes.{name} is written by {writers} but nothing reads it"


def test_no_scope_is_spelled_out_elsewhere():
    assert spelled_out() == []


@pytest.mark.parametrize("scope", [scopes.TRIPS, scopes.ROWS, scopes.FP8_TILE, scopes.IDLE])
def test_a_label_is_found_by_its_pattern(scope):
    op_name = f"jit(train_step)/moe/{scope.label(12)}/while/body/dot_general"
    assert scope.pattern.findall(op_name) == ["12"]
    assert scope.pattern.findall("jit(train_step)/moe/dot_general") == []


def test_a_compiled_program_keeps_the_label():
    """XLA keeps the scope in the instruction's metadata, where the planner reads it."""
    import jax
    import jax.numpy as jnp

    def f(x):
        with jax.named_scope(scopes.ROWS.label(7)):
            return x @ x

    text = jax.jit(f).lower(jnp.ones((4, 4))).compile().as_text()
    found = scopes.ROWS.pattern.findall(text)
    assert found and set(found) == {"7"}, found
