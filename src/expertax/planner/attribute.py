"""Attribution: the largest buffers alive at the peak of XLA's buffer assignment (read from its
text dumps, `hlo.py`), each with its HLO instruction, the file:line of our code that built it (the
innermost stack frame under src/expertax) and its checkpoint name, if any.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import os
import tempfile
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from expertax.parallel import remat
from expertax.planner import hlo
from expertax.planner.residuals import PACKAGE_DIR


@functools.lru_cache(maxsize=64)
def checkpoint_names(path: str) -> dict[int, str]:
    """line -> checkpoint name, for the lines of each `remat.tag(expr, remat.NAME)` in `path`.

    The tagged expression's lines map to the name (a nested tag's own lines to its own name), so
    an HLO instruction whose innermost frame is on one of them computes that named tensor.
    """
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return {}
    spans = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and len(node.args) == 2):
            continue
        fn, tag = node.func, node.args[1]
        is_tag = (
            isinstance(fn, ast.Attribute)
            and fn.attr == "tag"
            or (isinstance(fn, ast.Name) and fn.id == "tag")
        )
        if is_tag and isinstance(tag, ast.Attribute) and isinstance(tag.value, ast.Name):
            name = getattr(remat, tag.attr, None)
            if isinstance(name, str):
                expr = node.args[0]
                assert expr.end_lineno is not None and expr.end_col_offset is not None
                width = (expr.end_lineno - expr.lineno, expr.end_col_offset - expr.col_offset)
                spans.append((width, expr.lineno, expr.end_lineno, name))
    out = {}
    for _, first, last, name in sorted(spans, reverse=True):  # widest first, nested overwrite
        out.update(dict.fromkeys(range(first, last + 1), name))
    return out


def _our_frame(module: hlo.Module, frame: int) -> tuple[str, str]:
    """(file:line relative to src/expertax, absolute file) of the innermost expertax frame."""
    for f in hlo.call_stack(module, frame):
        path = os.path.abspath(f.file)
        if path.startswith(PACKAGE_DIR + os.sep):
            return f"{os.path.relpath(path, PACKAGE_DIR)}:{f.line}", path
        if f"{os.sep}src{os.sep}expertax{os.sep}" in path:  # traced from another checkout
            rel = path.split(f"{os.sep}src{os.sep}expertax{os.sep}", 1)[1]
            return f"{rel}:{f.line}", path
    return "", ""


_COLLECTIVES = {
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
}


def _describe(module, shapes, buf: hlo.LiveBuffer, host_names: set[str], stacks=()) -> dict:
    """One live buffer as a top_buffers entry."""
    instr = module.instructions.get(buf.instruction)
    text = shapes.get((buf.instruction, buf.index)) or (instr.shape if instr else "")
    shape = hlo.parse_shape(text) if text else hlo.Shape("?", (), False)
    index = "{" + ",".join(map(str, buf.index)) + "}" if buf.index else ""
    entry: dict[str, Any] = {
        "bytes": buf.bytes,
        "shape": list(shape.dims),
        "dtype": shape.dtype,
        "op": f"{buf.instruction}{index}" + (f" ({instr.opcode})" if instr else ""),
        "source": "",
        "name": "",
        "op_name": "",
        "placement": "host" if shape.host else "device",
        "note": "",
        "why": "",  # why no source line in our code, when there is none
    }
    if instr is None:
        entry["note"] = "not in the optimized HLO"
        return entry
    src = hlo.origin(module, buf.instruction, buf.index)
    entry["op_name"] = src.op_name
    entry["source"], path = _our_frame(module, src.frame)
    collective = instr.opcode.split("-start")[0].split("-done")[0] in _COLLECTIVES
    if path and not collective:  # SPMD's collectives carry their consumer's metadata
        entry["name"] = checkpoint_names(path).get(int(entry["source"].rsplit(":", 1)[1]), "")
    if src.opcode == "parameter" and src.computation not in module.callers and not src.frame:
        entry["name"] = entry["name"] or f"argument {src.op_name}".replace("\\'", "'")
    loop = module.callers.get(instr.computation) if instr.opcode == "parameter" else None
    if instr.opcode == "while":
        loop = instr.name
    if loop and buf.index:
        entry["note"] = f"while-loop tuple element {index} of {loop}"
    elif collective:
        entry["note"] = f"{instr.opcode} for {'/'.join(src.op_name.split('/')[-2:])}"
    elif src is not instr:
        what = "copy" if instr.opcode == "fusion" else instr.opcode  # a fusion that only copies
        entry["note"] = f"{what} of {src.name}"
    if not entry["name"] and (stacked := _stacked_residual(shape, stacks)):
        entry["name"] = stacked
    if not entry["source"] and not entry["name"]:
        entry["why"] = _why_no_source(module, instr, src, shape)
    if entry["name"] in host_names or any(
        entry["name"].startswith(f"argument {p}") for p in host_names
    ):
        entry["placement"] = "host"
    return entry


def _stacked_residual(shape: hlo.Shape, stacks) -> str:
    """The saved residual a buffer is the layer scan's stack of ([layers, *its shape], its
    dtype): XLA builds these stacks (and their host copies, when offloaded) without a Python
    source line. `stacks`: (name, dtype, per-layer shape, layers) of the config's residuals."""
    names = [
        name
        for name, dtype, dims, layers in stacks
        if layers > 1 and shape.dtype == dtype and tuple(shape.dims) == (layers, *dims)
    ]
    if not names:
        return ""
    layers = shape.dims[0]
    return f"{' or '.join(dict.fromkeys(names))} (the layer scan's stack of {layers} layers)"


def _why_no_source(module, instr, src, shape: hlo.Shape) -> str:
    """Why a buffer at the peak has no source line under src/expertax (nor an argument's name).

    The compiler made it without metadata (a constant, a tuple, a loop counter, an index
    computation), or JAX traced it outside our code (its name stack is given), or it is a value
    XLA created for a transformation (e.g. the zeros a scan's backward accumulates gradients in,
    named like `broadcast.369` with no JAX path); a buffer shaped like parameters says which.
    """
    like = _shaped_like_parameters(module, shape)
    like_text = f"; shaped like {', '.join(like)}" if like else ""
    if src.op_name and "/" in src.op_name:
        frames = hlo.call_stack(module, src.frame)
        where = f" at {os.path.basename(frames[0].file)}:{frames[0].line}" if frames else ""
        return f"traced by JAX outside src/expertax{where} ({src.op_name}){like_text}"
    made = f"made by XLA from its own instruction {src.op_name} (no Python source)"
    if src.op_name.startswith("broadcast"):
        return (
            f"{made}: a broadcast, e.g. the zeros a layer scan's backward sums the stacked "
            f"weights' gradients into{like_text}"
        )
    if src.op_name:
        return made + like_text
    return f"made by XLA ({instr.opcode}; no metadata, no Python source){like_text}"


def _shaped_like_parameters(module, shape: hlo.Shape) -> list[str]:
    """The entry parameters (state.params.*) of `shape`'s dtype and dims, by argument path."""
    if not shape.dims:
        return []
    out = []
    for instr in module.instructions.values():
        if instr.opcode != "parameter" or not instr.op_name.startswith("state.params."):
            continue
        if instr.computation in module.callers:
            continue
        other = hlo.parse_shape(instr.shape)
        if (other.dtype, other.dims) == (shape.dtype, shape.dims):
            out.append(instr.op_name.removeprefix("state.params."))
    return sorted(out)[:4]


def attribute_peak(dump_dir: str, top: int, host_names=(), stacks=()) -> dict:
    """The `top` largest buffers alive at the peak of the module dumped in `dump_dir`.

    `host_names`: checkpoint names and argument paths (e.g. "state.opt_state") the config places
    on host, for the placement column (XLA:CPU prints no host memory space); `stacks`: the
    residuals whose layer-scan stacks are named (`_stacked_residual`). Never raises for an
    unreadable dump: {"unavailable": why} instead.
    """
    try:
        files = hlo.module_files(dump_dir)
        with open(files["live_range"]) as f:
            peak = hlo.parse_live_range(f.read())
        with open(files["buffers"]) as f:
            shapes = hlo.parse_value_shapes(f.read())
        with open(files["hlo"]) as f:
            module = hlo.parse_hlo(f.read())
        ranked = sorted(peak.buffers, key=lambda b: -b.bytes)[:top]
        buffers = [_describe(module, shapes, b, set(host_names), stacks) for b in ranked]
    except (OSError, ValueError, KeyError, IndexError) as e:
        return {"unavailable": f"{type(e).__name__}: {e}", "top_buffers": []}
    return {
        "unavailable": None,
        "peak_step": peak.step,
        "peak_instruction": peak.instruction,
        "peak_buffers": len(peak.buffers),
        "peak_live_bytes": sum(b.bytes for b in peak.buffers),
        "top_buffers": buffers,
    }


def compile_and_attribute(trainer, top: int, host_names=(), stacks=()):
    """Compile the train step abstractly; with `top` > 0, also attribute its peak (XLA's dumps
    go to a temporary folder, removed afterwards)."""
    with trainer.context():
        lowered = trainer.jitted_step().lower(trainer.abstract_state(), trainer.abstract_batch())
    if top <= 0:
        with trainer.context():
            return lowered.compile(), {"unavailable": "not asked for (--top 0)", "top_buffers": []}
    with tempfile.TemporaryDirectory(prefix="expertax-xla-dump-") as tmp:
        options = {"xla_dump_to": tmp, "xla_dump_hlo_as_text": True}
        with trainer.context(), _persistent_cache_off():
            compiled = lowered.compile(compiler_options=options)
        return compiled, attribute_peak(tmp, top, host_names, stacks)


@contextlib.contextmanager
def _persistent_cache_off():
    """JAX's persistent compilation cache off for one compile: its key leaves out the dump
    options, so with a cache configured (`jax_compilation_cache_dir`) a step compiled before is
    read back instead of compiled, and XLA writes no dump to attribute."""
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once per process whether the cache is used
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()
