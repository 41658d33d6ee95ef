"""Imports point one way (config -> sharding -> nn -> models -> parallel -> train -> tools/cli),
with no circle anywhere.

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


def module_graph() -> dict[str, set[str]]:
    """Every expertax module (dotted name) -> the expertax modules it imports, deferred imports
    included (`from expertax.a import b` counts as `expertax.a.b` when that is a module, else as
    `expertax.a`)."""
    modules = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        modules[".".join(parts)] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    found.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_deferred_imports_included():
    """A package's `__init__` importing its own modules is not a circle unless a module imports
    the package back; any other circle is, however deep inside a function the import sits."""
    graph = module_graph()
    for name in graph:  # a package's __init__ re-exporting its own modules: the modules' side
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    assert circles(graph) == []


def test_the_circle_check_finds_a_circle():
    """Negative control: a two-module circle and a three-module one are found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(circles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_config_knows_fields_only():
    """The config package imports none of the layers that read it: the kernels' facts and the
    checks that need them live in nn, parallel and sharding, collected by `expertax.preflight`."""
    lower = ("expertax.nn", "expertax.models", "expertax.sharding", "expertax.parallel")
    assert offenders("config", lower + ("expertax.preflight", "expertax.fp8")) == []


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
