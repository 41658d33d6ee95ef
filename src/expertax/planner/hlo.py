"""Read XLA's text dumps of one compiled module: the buffers alive at its memory peak.

`compiled = lowered.compile(compiler_options={"xla_dump_to": DIR, "xla_dump_hlo_as_text": True})`
writes, per module, `module_NNNN.<name>.cpu_after_optimizations*.txt` (`cpu_`: the backend):
- `-live-range.txt`: the flattened schedule of every computation and, in a section
  "Live ranges at N (peak):", one line `instr{index}: BYTES bytes (cumulative: ...)` per buffer
  alive at the peak (`index` is a tuple index, empty for an array);
- `-buffer-assignment.txt`: allocations and their values,
  `value: <ID instr{index} (phi) @POS> (size=S,offset=O): SHAPE` (`{index}`, `(phi)` optional);
- `.txt`: the optimized HLO; each instruction's `metadata={op_name="..." stack_frame_id=K}`, and
  at the top the tables FileNames, FunctionNames, FileLocations, StackFrames that resolve K to a
  call stack.

The parsers here are plain text functions; a missing file or section raises `DumpError` naming
what is missing, so a caller can say why attribution is unavailable.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

# XLA primitive type -> numpy dtype name.
_DTYPES = {
    "pred": "bool",
    "s4": "int4",
    "s8": "int8",
    "s16": "int16",
    "s32": "int32",
    "s64": "int64",
    "u4": "uint4",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "c64": "complex64",
    "c128": "complex128",
    "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
}
HOST_MEMORY_SPACE = 5  # `S(5)` in a layout: pinned host memory (XLA's kHostMemorySpace)


class DumpError(ValueError):
    """A dump file or section that attribution needs is missing or unreadable."""


@dataclasses.dataclass(frozen=True)
class LiveBuffer:
    """One buffer alive at the peak: `instruction{index}` and its size."""

    instruction: str
    index: tuple[int, ...]  # the tuple index; () for an array value
    bytes: int


@dataclasses.dataclass(frozen=True)
class Peak:
    step: int  # position in the flattened schedule
    instruction: str  # the instruction scheduled at the peak ("" when the schedule is absent)
    buffers: tuple[LiveBuffer, ...]


@dataclasses.dataclass(frozen=True)
class Shape:
    dtype: str  # numpy name, or "tuple"
    dims: tuple[int, ...]
    host: bool  # the layout puts it in pinned host memory (S(5))


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # as printed, layout included
    opcode: str
    computation: str
    operands: tuple[str, ...]
    op_name: str
    frame: int  # stack_frame_id, 0 when none
    attrs: str  # the rest of the line after the operands (calls=, body=, index=, ...)
    args: str = ""  # the text between the operand parentheses: a constant's literal, parameter(N)


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    parent: int  # 0: outermost


@dataclasses.dataclass
class Module:
    instructions: dict[str, Instruction]
    frames: dict[int, Frame]
    roots: dict[str, str]  # computation -> its ROOT instruction
    callers: dict[str, str]  # while body/condition computation -> the while instruction
    entry: str = ""  # the ENTRY computation


def parse_index(text: str) -> tuple[int, ...]:
    """`{}` / `{12}` / `{1,2}` -> (), (12,), (1, 2)."""
    inner = text.strip().strip("{}").strip()
    return tuple(int(x) for x in inner.split(",")) if inner else ()


_PEAK_RE = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_LIVE_RE = re.compile(r"^\s*(\S+?)(\{[\d,\s]*\})?:\s*(\d+) bytes")
_SEQ_RE = re.compile(r"^\s*(\d+):(\S+)\s*$")


def parse_live_range(text: str) -> Peak:
    """The buffers alive at the peak, from a `-live-range.txt` dump."""
    lines = text.splitlines()
    peaks = [(i, m) for i, m in enumerate(map(_PEAK_RE.match, lines)) if m]
    if not peaks:
        raise DumpError("the live-range dump has no 'Live ranges at N (peak):' section")
    start, peak = peaks[0]
    step = int(peak.group(1))
    buffers = []
    for ln in lines[start + 1 :]:
        m = _LIVE_RE.match(ln)
        if m is None:
            break
        buffers.append(LiveBuffer(m.group(1), parse_index(m.group(2) or ""), int(m.group(3))))
    if not buffers:
        raise DumpError("the live-range dump's peak section lists no buffers")
    seq: dict[str, str] = {}
    for m in map(_SEQ_RE.match, lines[:start]):
        if m:
            seq[m.group(1)] = m.group(2)
    return Peak(step, seq.get(str(step), ""), tuple(buffers))


_VALUE_RE = re.compile(
    r"^\s*value: <\d+ (\S+?)(\{[\d,\s]*\})?(?: \(phi\))? @\d+> \(size=\d+,offset=\d+\): (.+?)\s*$"
)


def parse_value_shapes(text: str) -> dict[tuple[str, tuple[int, ...]], str]:
    """(instruction, index) -> its shape, from a `-buffer-assignment.txt` dump."""
    out: dict[tuple[str, tuple[int, ...]], str] = {}
    for ln in text.splitlines():
        m = _VALUE_RE.match(ln)
        if m:
            out.setdefault((m.group(1), parse_index(m.group(2) or "")), m.group(3))
    if not out:
        raise DumpError("the buffer-assignment dump lists no values")
    return out


_ARRAY_RE = re.compile(r"^([a-z]\w*)\[([\d,]*)\](\{[^}]*\})?$")


def parse_shape(text: str) -> Shape:
    """`f32[2,16]{1,0}` -> Shape("float32", (2, 16), host=False); a tuple -> dtype "tuple"."""
    text = text.strip()
    if text.startswith("("):
        return Shape("tuple", (), False)
    m = _ARRAY_RE.match(text)
    if m is None:
        raise DumpError(f"unreadable HLO shape {text!r}")
    dims = tuple(int(d) for d in m.group(2).split(",") if d)
    host = f"S({HOST_MEMORY_SPACE})" in (m.group(3) or "")
    return Shape(_DTYPES.get(m.group(1), m.group(1)), dims, host)


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    in_str = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            in_str = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch == '"':
            in_str = True
        elif ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise DumpError(f"unbalanced brackets in HLO line {text[:120]!r}")


_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ")
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")
_TABLE_RE = re.compile(r"^(\d+) (.*)$")
_OP_NAME_RE = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME_RE = re.compile(r"stack_frame_id=(\d+)")
_BODY_RE = re.compile(r"\b(body|condition)=%?([\w.\-]+)")


def _parse_instruction(line: str, computation: str) -> Instruction | None:
    m = _INSTR_RE.match(line)
    if m is None:
        return None
    rest = line[m.end() :]
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren].strip()
    close = _balanced(rest, paren)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[paren:close]))
    attrs = rest[close:]
    op_name = _OP_NAME_RE.search(attrs)
    frame = _FRAME_RE.search(attrs)
    return Instruction(
        m.group(1),
        shape,
        opcode,
        computation,
        operands,
        op_name.group(1) if op_name else "",
        int(frame.group(1)) if frame else 0,
        attrs,
        rest[paren + 1 : close - 1],
    )


def _fields(text: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+?)(?=[\s}]|$)", text))


def _logical_lines(text: str) -> list[str]:
    """The dump's lines with an instruction's continuation lines joined to it: a kernel's
    metadata (MaxText's Pallas kernels) may hold newlines, printed as they are, so a line inside
    a computation that is not indented, not its closing brace and not a computation's header
    continues the instruction above."""
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.startswith(" ") or not line:
            out.append(line)
        elif line.rstrip() == "}":
            inside = False
            out.append(line)
        elif inside and out and out[-1].startswith(" ") and not _COMP_RE.match(line):
            out[-1] += "\n" + line
        else:
            inside = bool(_COMP_RE.match(line))
            out.append(line)
    return out


def parse_hlo(text: str) -> Module:
    """Instructions, computations and stack frames of an optimized-HLO text dump.

    StackFrames prints `parent_frame_id` one above the parent's id (0 is no parent): in the
    dump of `jit(grad(f))`, f's frames name as parent the frame of the line that traced f.
    """
    sections: dict[str, dict[int, str]] = {}
    instructions: dict[str, Instruction] = {}
    roots: dict[str, str] = {}
    callers: dict[str, str] = {}
    section = None
    computation = None
    open_computation = None  # the computation whose closing brace has not come yet
    entry = ""
    for line in _logical_lines(text):
        if line.rstrip() == "}":
            open_computation = None
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = sections.setdefault(line, {})
            continue
        if section is not None and (m := _TABLE_RE.match(line)):
            section[int(m.group(1))] = m.group(2)
            continue
        section = None
        if not line.startswith(" ") and (m := _COMP_RE.match(line)):
            computation = open_computation = m.group(1)
            entry = computation if line.startswith("ENTRY") else entry
            continue
        if computation is None or not line.startswith(" "):
            continue
        instr = _parse_instruction(line, computation)
        if instr is None:
            continue
        instructions[instr.name] = instr
        if line.lstrip().startswith("ROOT "):
            roots[computation] = instr.name
        if instr.opcode == "while":
            for _, called in _BODY_RE.findall(instr.attrs):
                callers[called] = instr.name
    if not instructions:
        raise DumpError("the optimized-HLO dump has no instructions")
    if open_computation is not None:  # a file cut short (a copy or a write that stopped)
        raise DumpError(
            f"the optimized-HLO text is truncated: computation {open_computation!r} has no "
            "closing brace"
        )
    files = {k: v.strip('"') for k, v in sections.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in sections.get("FunctionNames", {}).items()}
    locations = {k: _fields(v) for k, v in sections.get("FileLocations", {}).items()}
    frames = {}
    for k, v in sections.get("StackFrames", {}).items():
        f = _fields(v)
        loc = locations.get(int(f.get("file_location_id", 0)), {})
        frames[k] = Frame(
            files.get(int(loc.get("file_name_id", 0)), "?"),
            int(loc.get("line", 0)),
            functions.get(int(loc.get("function_name_id", 0)), "?"),
            max(int(f.get("parent_frame_id", 0)) - 1, 0),
        )
    return Module(instructions, frames, roots, callers, entry)


def call_stack(module: Module, frame: int) -> list[Frame]:
    """The frames of `frame`, innermost first."""
    out, seen = [], set()
    while frame and frame in module.frames and frame not in seen:
        seen.add(frame)
        out.append(module.frames[frame])
        frame = module.frames[frame].parent
    return out


_PASS_THROUGH = ("copy", "bitcast", "reshape", "copy-start", "copy-done", "transpose", "convert")


# A fusion's (or call's) computation: `calls=%name`.
CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")


def _moves_operand(module: Module, fusion: Instruction) -> bool:
    """Whether a fusion only moves its one operand (XLA's `wrapped_copy`, a layout change: its
    computation's root is a copy, bitcast, transpose, ...)."""
    m = CALLS_RE.search(fusion.attrs)
    root = module.instructions.get(module.roots.get(m.group(1), "")) if m else None
    return root is not None and root.opcode in _PASS_THROUGH


def origin(module: Module, name: str, index: tuple[int, ...] = (), hops: int = 12) -> Instruction:
    """The instruction whose metadata describes the value `name{index}`.

    Copies, bitcasts and tuple plumbing carry no metadata; follow them to the value they move: a
    copy (or a fusion that only copies) to its operand, a get-tuple-element to its tuple, a tuple
    element to its operand, a while loop's body parameter to the loop's initial value, a while
    loop's output to its body's result.
    """
    instr = module.instructions[name]
    if instr.frame or hops == 0:
        return instr
    nxt: tuple[str, tuple[int, ...]] | None = None
    if instr.opcode in _PASS_THROUGH and instr.operands:
        nxt = instr.operands[0], index
    elif instr.opcode == "fusion" and len(instr.operands) == 1 and _moves_operand(module, instr):
        nxt = instr.operands[0], index
    elif instr.opcode == "get-tuple-element" and instr.operands:
        m = re.search(r"\bindex=(\d+)", instr.attrs)
        nxt = (instr.operands[0], (int(m.group(1)), *index)) if m else None
    elif instr.opcode == "tuple" and index and index[0] < len(instr.operands):
        nxt = instr.operands[index[0]], index[1:]
    elif instr.opcode == "parameter" and instr.computation in module.callers:
        loop = module.instructions[module.callers[instr.computation]]
        nxt = (loop.operands[0], index) if loop.operands else None
    elif instr.opcode == "while":
        body = dict(_BODY_RE.findall(instr.attrs)).get("body")
        nxt = (module.roots[body], index) if body in module.roots else None
    if nxt is None or nxt[0] not in module.instructions:
        return instr
    found = origin(module, *nxt, hops=hops - 1)
    return found if found.frame or found.op_name else instr


def module_files(dump_dir: str, module_name: str = "*") -> dict[str, str]:
    """The dump files of one module (`module_name` a glob, e.g. "jit_train_step").

    Several modules matching: the one with the largest optimized HLO (a compile dumps the
    program it was asked for, and rarely small helper modules beside it).
    """
    kinds = {  # after the backend's prefix: cpu_, or e.g. sm_9.0_gpu_
        "hlo": "after_optimizations.txt",
        "live_range": "after_optimizations-live-range.txt",
        "buffers": "after_optimizations-buffer-assignment.txt",
    }
    hlos = glob.glob(os.path.join(dump_dir, f"module_*.{module_name}.*{kinds['hlo']}"))
    if not hlos:
        listing = sorted(os.listdir(dump_dir)) if os.path.isdir(dump_dir) else []
        have = [f for f in listing if f.endswith(".txt")][:6]
        raise DumpError(f"no optimized HLO of module {module_name!r} in the dump ({have})")
    prefix = max(hlos, key=os.path.getsize)[: -len(kinds["hlo"])]
    out = {}
    for kind, suffix in kinds.items():
        if not os.path.exists(prefix + suffix):
            raise DumpError(f"the XLA dump has no {os.path.basename(prefix + suffix)}")
        out[kind] = prefix + suffix
    return out
