"""Imports point one way (config -> sharding -> nn -> models -> parallel -> train -> tools/cli).

Read from the source (static imports, deferred ones included), so a cycle hidden by an import
inside a function is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import expertax

SRC = Path(expertax.__file__).parent


def imports_of(package: str) -> dict[str, set[str]]:
    """Module path (relative to src/expertax) -> the expertax modules it imports."""
    out = {}
    for path in sorted((SRC / package).rglob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        out[str(path.relative_to(SRC))] = {m for m in found if m.startswith("expertax")}
    return out


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{module} imports {name}"
        for module, names in imports_of(package).items()
        for name in sorted(names)
        if name.startswith(forbidden)
    ]


def test_nn_and_sharding_do_not_load_yaml_presets():
    for package in ("nn", "sharding"):
        assert offenders(package, ("expertax.config.loader",)) == []


def test_lower_layers_never_import_the_trainer_tools_or_converters():
    upper = (
        "expertax.train",
        "expertax.tools",
        "expertax.planner",
        "expertax.convert",
        "expertax.cli",
    )
    for package in ("config", "sharding", "nn", "models", "parallel", "data"):
        assert offenders(package, upper) == []


def test_train_does_not_import_convert_or_tools():
    upper = ("expertax.convert", "expertax.tools", "expertax.planner", "expertax.cli")
    assert offenders("train", upper) == []


def test_the_check_finds_an_offender():
    """Negative control: convert does import train (allowed), and the check sees it."""
    assert offenders("convert", ("expertax.train",)) != []


def test_the_command_module_imports_no_jax_before_its_reexecution():
    """`expertax` re-executes itself before any work (cli.command): importing expertax.cli must
    not load JAX or the config (whose checks load JAX), or the re-execution would come late."""
    import subprocess
    import sys

    code = (
        "import sys, expertax.cli; print(sorted(m for m in sys.modules"
        " if m in ('jax', 'pydantic') or m.startswith('expertax.config')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_private_module_of_jax_or_a_library_is_imported():
    """No `jax._src` (nor any `_src` / underscore package of a library) in expertax's imports or
    import_module strings; the one private name read (tokamax's op table) is a guarded constant
    in nn/moe/gmm_kernels.py with its own test."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
                names = [a.value for a in node.args if isinstance(a, ast.Constant)]
            for name in names:
                if not name.startswith("expertax") and any(
                    part.startswith("_") and not part.startswith("__") for part in name.split(".")
                ):
                    found.append(f"{path.relative_to(SRC)}: {name}")
    assert found == []
