"""`expertax memory --top N`: the largest buffers at XLA's peak, with our file:line.

The parsers are tested on a small dump written here (a while loop, tuple plumbing, stack frames,
a missing section); the attribution end to end on a config whose float32 logits [B, T, V] must be
the largest buffer.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import textwrap

import jax
import pytest

from expertax import cli
from expertax.parallel import remat
from expertax.planner import attribute, hlo
from expertax.preflight import load_config
from expertax.train.trainer import build_trainer

PACKAGE = os.path.dirname(os.path.abspath(attribute.__file__)).rsplit(os.sep, 1)[0]
DECODER_PY = os.path.join(PACKAGE, "models", "decoder.py")
# The line that tags the layer input: the fixed dump's frame 2 points at it.
TAG_LINE = next(
    i
    for i, ln in enumerate(open(DECODER_PY).read().splitlines(), 1)
    if "remat.DECODER_LAYER_INPUT)" in ln
)

LIVE_RANGE = """\
HloLiveRange (max 6):
  InstructionSequence:
    0:p0
    1:init
    2:while.1
    3:gte
    4:out
  BufferLiveRange:
    p0{}:0-6
  Live ranges at 3 (peak):
    while.1{1}: 4096 bytes (cumulative: 4096 bytes)
    out{}: 2048 bytes (cumulative: 6144 bytes)
    p0{}: 64 bytes (cumulative: 6208 bytes)
    body_param{1}: 1024 bytes (cumulative: 7232 bytes)
  Stack trace breakdown for peak usage: 7 232 bytes
"""

BUFFERS = """\
BufferAssignment:
allocation 0: size 4096, maybe-live-out:
 value: <7 while.1{1} @0> (size=4096,offset=0): f32[32,32]{1,0}
 value: <8 body_param{1} (phi) @0> (size=1024,offset=0): bf16[16,32]{1,0}
allocation 1: size 2048, parameter 0:
 value: <9 out @0> (size=2048,offset=0): f32[512]{0:S(5)}
 value: <10 p0 @0> (size=64,offset=0): s32[16]{0}
"""

HLO = """\
HloModule jit_step, is_scheduled=true

FileNames
1 "/elsewhere/driver.py"
2 "{pkg}/models/decoder.py"

FunctionNames
1 "<module>"
2 "forward"

FileLocations
1 {{file_name_id=1 function_name_id=1 line=9 end_line=9 column=1 end_column=5}}
2 {{file_name_id=2 function_name_id=2 line={line} end_line={line} column=3 end_column=9}}

StackFrames
1 {{file_location_id=1 parent_frame_id=1}}
2 {{file_location_id=2 parent_frame_id=2}}


%body (body_param: (s32[], f32[32,32])) -> (s32[], f32[32,32]) {{
  %body_param = (s32[], f32[32,32]{{1,0}}) parameter(0)
  %upd = f32[32,32]{{1,0}} add(%x, %y), {meta_add}
  ROOT %t = (s32[], f32[32,32]{{1,0}}) tuple(%a, %upd)
}}

%cond (cond_param: (s32[], f32[32,32])) -> pred[] {{
  %cond_param = (s32[], f32[32,32]{{1,0}}) parameter(0)
  ROOT %lt = pred[] compare(%x, %y), direction=LT
}}

ENTRY %main (p0: s32[16]) -> f32[512] {{
  %p0 = s32[16]{{0}} parameter(0), metadata={{op_name="state.params[\\'w\\']"}}
  %fill = f32[32,32]{{1,0}} broadcast(%c), dimensions={{}}, {meta_fill}
  %init = (s32[], f32[32,32]{{1,0}}) tuple(%zero, %fill)
  %while.1 = (s32[], f32[32,32]{{1,0}}) while(%init), condition=%cond, body=%body
  %gte = f32[32,32]{{1,0}} get-tuple-element(%while.1), index=1
  ROOT %out = f32[512]{{0:S(5)}} copy(%gte)
}}
"""


FILLED = dict(
    pkg=PACKAGE,
    line=TAG_LINE,
    meta_add='metadata={op_name="jit(step)/while/body/add" stack_frame_id=2}',
    meta_fill='metadata={op_name="jit(step)/broadcast_in_dim" stack_frame_id=2}',
)


def _write_dump(folder, *, live=LIVE_RANGE, buffers=BUFFERS, hlo=None):
    prefix = os.path.join(folder, "module_0007.jit_step.cpu_after_optimizations")
    parts = {
        ".txt": HLO.format(**FILLED) if hlo is None else hlo,
        "-live-range.txt": live,
        "-buffer-assignment.txt": buffers,
    }
    for suffix, text in parts.items():
        if text is not None:
            with open(prefix + suffix, "w") as f:
                f.write(text)


def test_parsers_on_a_small_dump():
    peak = hlo.parse_live_range(LIVE_RANGE)
    assert (peak.step, peak.instruction) == (3, "gte")
    assert [(b.instruction, b.index, b.bytes) for b in peak.buffers] == [
        ("while.1", (1,), 4096),
        ("out", (), 2048),
        ("p0", (), 64),
        ("body_param", (1,), 1024),
    ]
    shapes = hlo.parse_value_shapes(BUFFERS)
    assert shapes[("body_param", (1,))] == "bf16[16,32]{1,0}"
    assert hlo.parse_shape(shapes[("out", ())]) == hlo.Shape("float32", (512,), True)
    assert hlo.parse_shape("(s32[], f32[2])").dtype == "tuple"
    module = hlo.parse_hlo(HLO.format(**FILLED))
    assert module.callers == {"body": "while.1", "cond": "while.1"}
    assert module.roots["body"] == "t" and module.instructions["fill"].frame == 2
    # parent_frame_id is printed one above the parent: frame 2's parent is frame 1, not itself.
    assert [(f.file, f.line) for f in hlo.call_stack(module, 2)] == [
        (DECODER_PY, TAG_LINE),
        ("/elsewhere/driver.py", 9),
    ]
    # Metadata-less plumbing is followed to the value it moves.
    assert hlo.origin(module, "out").name == "upd"  # copy -> gte -> while -> body root
    assert hlo.origin(module, "body_param", (1,)).name == "fill"  # loop init, element 1
    assert hlo.origin(module, "body_param", (0,)).name == "body_param"  # %zero: unknown


def test_attribute_peak_on_a_small_dump(tmp_path):
    _write_dump(str(tmp_path))
    a = attribute.attribute_peak(str(tmp_path), top=3, host_names={"state.params"})
    assert a["unavailable"] is None and a["peak_live_bytes"] == 7232
    top = a["top_buffers"]
    assert [b["bytes"] for b in top] == [4096, 2048, 1024]  # largest first, cut at 3
    assert top[0]["shape"] == [32, 32] and top[0]["dtype"] == "float32"
    assert top[0]["source"] == f"models/decoder.py:{TAG_LINE}"
    assert top[0]["name"] == remat.DECODER_LAYER_INPUT
    assert top[0]["note"] == "while-loop tuple element {1} of while.1"
    assert top[1]["placement"] == "host"  # S(5) in its layout
    assert top[2]["dtype"] == "bfloat16" and "while-loop tuple" in top[2]["note"]
    a = attribute.attribute_peak(str(tmp_path), top=10, host_names={"state.params"})
    arg = a["top_buffers"][-1]
    assert arg["name"] == "argument state.params['w']" and arg["placement"] == "host"


def test_a_buffer_without_our_source_says_why(tmp_path):
    """A value XLA made itself (op_name without a JAX path, no stack frame: the zeros a scan's
    backward accumulates in) gets no source line; the entry says why and which parameters it is
    shaped like. XLA's layout copy of an argument (a fusion that only copies) is that argument."""
    meta = dict(FILLED, meta_fill='metadata={op_name="broadcast.369"}')
    text = HLO.format(**meta).replace(
        "  %fill =",
        '  %p1 = bf16[16,32]{1,0} parameter(1), metadata={op_name="state.params.moe.wi_0"}\n'
        "  %p1c = bf16[16,32]{0,1} fusion(%p1), kind=kLoop, calls=%wrapped_copy_computation\n"
        "  %fill =",
    )
    text = text.replace(
        "ENTRY",
        "%wrapped_copy_computation (param_0: bf16[16,32]) -> bf16[16,32] {\n"
        "  %param_0 = bf16[16,32]{1,0} parameter(0)\n"
        "  ROOT %copy.9 = bf16[16,32]{0,1} copy(%param_0)\n}\n\nENTRY",
    )
    extra = "    p1c{}: 1024 bytes (cumulative: 8256 bytes)\n"
    live = LIVE_RANGE.replace("  Stack trace", extra + "  Stack trace")
    buffers = BUFFERS + " value: <11 p1c @0> (size=1024,offset=0): bf16[16,32]{0,1}\n"
    _write_dump(str(tmp_path), hlo=text, live=live, buffers=buffers)
    top = attribute.attribute_peak(str(tmp_path), top=10)["top_buffers"]
    carry = next(b for b in top if b["op"].startswith("body_param"))
    assert carry["source"] == "" and carry["name"] == ""
    assert "made by XLA from its own instruction broadcast.369" in carry["why"]
    assert carry["why"].endswith("shaped like moe.wi_0")
    copy = next(b for b in top if b["op"].startswith("p1c"))
    assert copy["name"] == "argument state.params.moe.wi_0" and copy["note"] == "copy of p1"
    assert copy["why"] == ""
    ours = next(b for b in top if b["op"].startswith("while.1"))
    assert ours["source"] and ours["why"] == ""  # negative control: our code made it


@pytest.mark.parametrize(
    "broken, why",
    [
        ({"live": LIVE_RANGE.split("  Live ranges")[0]}, "no 'Live ranges at N (peak):'"),
        ({"buffers": None}, "buffer-assignment.txt"),
        ({"buffers": "BufferAssignment:\n"}, "lists no values"),
        ({"hlo": "HloModule x\n"}, "has no instructions"),
    ],
)
def test_a_missing_section_makes_attribution_unavailable(tmp_path, broken, why):
    _write_dump(str(tmp_path), **broken)
    a = attribute.attribute_peak(str(tmp_path), top=5)
    assert a["top_buffers"] == [] and why in a["unavailable"]
    with pytest.raises(hlo.DumpError):
        hlo.parse_live_range("HloLiveRange (max 1):\n")
    empty = attribute.attribute_peak(str(tmp_path / "nothing"), top=5)
    assert "no optimized HLO" in empty["unavailable"]


def test_checkpoint_names_cover_the_tagged_expression(tmp_path):
    src = tmp_path / "layer.py"
    src.write_text(
        textwrap.dedent(
            """\
            y = remat.tag(
                jnp.einsum("btd,df->btf", x, w),
                remat.MLPWO,
            )
            z = remat.tag(remat.tag(y, remat.OUT_PROJ) + 1, remat.MOE_MLPWO)
            w = f(y, remat.MLPWO)
            """
        )
    )
    names = attribute.checkpoint_names(str(src))
    assert names == {2: remat.MLPWO, 5: remat.OUT_PROJ}  # the innermost tag wins on line 5
    mla = os.path.join(PACKAGE, "nn", "attention", "mla.py")
    lines = open(mla).read().splitlines()
    at = next(i for i, ln in enumerate(lines, 1) if "remat.QUERY_WA_PROJ)" in ln)
    assert attribute.checkpoint_names(mla)[at] == remat.QUERY_WA_PROJ


def _lines_of(path: str, start: str, stop: str) -> set[int]:
    """Lines from the first containing `start` to the next containing `stop`."""
    lines = open(path).read().splitlines()
    first = next(i for i, ln in enumerate(lines, 1) if start in ln)
    last = next(i for i, ln in enumerate(lines[first - 1 :], first) if stop in ln)
    return set(range(first, last + 1))


def test_attribution_with_a_persistent_compilation_cache(tmp_path, monkeypatch):
    """A step already in JAX's persistent cache is still compiled (and dumped) for attribution:
    the cache key leaves out the dump options. Negative control: without the switch the second
    compile is read back from the cache and XLA writes no dump."""
    from jax.experimental.compilation_cache import compilation_cache

    c = load_config(overrides={"model_name": "llama-tiny", "base_num_decoder_layers": 1})
    trainer = build_trainer(c)
    settings = {
        "jax_compilation_cache_dir": str(tmp_path / "cache"),
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_enable_compilation_cache": True,
    }
    saved = {k: getattr(jax.config, k) for k in settings}
    for k, v in settings.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()
    try:
        attribute.compile_and_attribute(trainer, top=0)  # fills the cache
        with monkeypatch.context() as m:
            m.setattr(attribute, "_persistent_cache_off", contextlib.nullcontext)
            assert attribute.compile_and_attribute(trainer, top=3)[1]["unavailable"]
        assert attribute.compile_and_attribute(trainer, top=3)[1]["unavailable"] is None
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()


def test_big_vocab_logits_are_the_top_buffer_with_our_line(tmp_path, capsys):
    vocab, t = 8192, 256
    overrides = [
        "model_name=deepseek3-tiny",
        "base_num_decoder_layers=2",
        f"max_target_length={t}",
        "per_device_batch_size=1",
        f"vocab_size={vocab}",
    ]
    path = tmp_path / "m.json"
    assert cli.main(["memory", *overrides, "--top", "6", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "largest buffers alive at XLA's peak" in out
    r = json.loads(path.read_text())
    assert r["attribution"]["unavailable"] is None
    top = r["top_buffers"]
    assert len(top) == 6 and [b["bytes"] for b in top] == sorted(
        (b["bytes"] for b in top), reverse=True
    )
    for b in top:
        assert set(b) >= {"bytes", "shape", "dtype", "op", "source", "name"}
        assert isinstance(b["bytes"], int) and all(isinstance(s, int) for s in b["shape"])
        assert isinstance(b["op"], str) and isinstance(b["source"], str)
    # The float32 logits [B, T, V] per device (or their gradient): 1 x 256 x 8192 x 4 = 8 MiB,
    # more than any weight, its gradient or its optimizer state (8192 x 128 x 4 = 4 MiB).
    # XLA may drop the batch dim of size one: [T, V] is the same buffer.
    assert top[0]["shape"] in ([1, t, vocab], [t, vocab]), top[:2]
    assert (top[0]["dtype"], top[0]["bytes"]) == ("float32", 4 * t * vocab)
    step_py = os.path.join(PACKAGE, "train", "step.py")
    ours = {f"models/decoder.py:{n}" for n in _lines_of(DECODER_PY, "def logits(", "return")}
    ours |= {
        f"train/step.py:{n}"
        for n in _lines_of(step_py, "def _nll_sum(", "return vocab_loss.nll_sum(")
    }
    assert top[0]["source"] in ours, (top[0], sorted(ours))
    assert top[0]["source"] in out  # and the text table shows it
    # ideal_parameter_bytes, independently: every parameter's bytes over the 8 devices.
    c = load_config(overrides=overrides)
    params = build_trainer(c).abstract_state().params
    total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert r["ideal_parameter_bytes"] == math.ceil(total / 8)
    assert vocab * 128 * 4 * 2 / 8 < r["ideal_parameter_bytes"] < r["parameter_bytes"] * 1.1


def test_top_zero_skips_attribution(capsys):
    args = ["memory", "model_name=llama-tiny", "base_num_decoder_layers=1", "--top", "0"]
    assert cli.main([*args, "max_target_length=16"]) == 0
    assert "attribution unavailable: not asked for (--top 0)" in capsys.readouterr().out
