"""`expertax parity --compile-only`: reading a compiled program's text, and the flags it refuses.
The compiles themselves: tests/distributed/test_parity_compile.py."""

from __future__ import annotations

import pytest

from expertax import cli
from expertax.preflight import load_config
from expertax.tools.parity import compile_only as parity_compile
from expertax.tools.parity.layouts import parse_layout

# A hand-written optimized-HLO text: the padded exchange's all-to-all (frame 2: exchange.py's
# padded_all_to_all), the ragged exchange's offsets all-to-all (frame 3: exchange.py's
# all_to_all) and the embedding's (no frame), a ragged all-to-all, async collectives (the
# `-done` not counted), a bookkeeping custom call, a cuBLAS GEMM and a Triton GEMM fusion.
HLO = """HloModule jit_train_step

FileNames
1 "/src/expertax/nn/moe/exchange.py"
2 "/src/expertax/nn/moe/ep.py"

FunctionNames
1 "padded_all_to_all"
2 "all_to_all"
3 "send"

FileLocations
1 {file_name_id=2 function_name_id=3 line=10 end_line=10 column=1 end_column=1}
2 {file_name_id=1 function_name_id=1 line=20 end_line=20 column=1 end_column=1}
3 {file_name_id=1 function_name_id=2 line=30 end_line=30 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=2}

ENTRY %main (p: f32[8,4]) -> f32[8,4] {
  %p = f32[8,4]{1,0} parameter(0)
  %a2a.1 = f32[8,4]{1,0} all-to-all(%p), dimensions={0}, metadata={op_name="a" stack_frame_id=2}
  %a2a.2 = s32[8]{0} all-to-all(%p), dimensions={0}, metadata={op_name="b" stack_frame_id=3}
  %a2a.3 = f32[8,4]{1,0} all-to-all(%p), dimensions={0}, metadata={op_name="embed"}
  %r = f32[8,4]{1,0} ragged-all-to-all(%p, %p, %p, %p, %p, %p), metadata={op_name="r"}
  %ag = f32[8,4]{1,0} all-gather-start(%p), dimensions={0}
  %agd = f32[8,4]{1,0} all-gather-done(%ag)
  %buf = f32[8,4]{1,0} custom-call(), custom_call_target="AllocateBuffer"
  %mm = f32[8,4]{1,0} custom-call(%p, %p), custom_call_target="__cublas$gemm"
  ROOT %f = f32[8,4]{1,0} fusion(%p), kind=kCustom, backend_config={"kind":"__triton_gemm"}
}
"""


def test_program_summary_counts_collectives_padded_exchange_and_kernels():
    s = parity_compile.program_summary(HLO)
    assert s["collectives"] == {"ragged-all-to-all": 1, "all-to-all": 3, "all-gather": 1}
    assert s["padded_exchange"] == 1  # only the all-to-all traced in padded_all_to_all
    assert s["kernels"] == {"cublas": 1, "triton-gemm": 1}
    assert parity_compile.exchange_found(s) == "ragged+padded"
    assert (
        parity_compile.exchange_found({"collectives": {"all-to-all": 2}, "padded_exchange": 0})
        == "-"
    )


def test_expected_exchange_follows_the_platform():
    c = load_config(overrides=["model_name=deepseek3-tiny", "a2a_impl=auto"])
    assert parity_compile.expected_exchange(c, "tpu", 8) == "ragged"
    assert parity_compile.expected_exchange(c, "gpu", 8) == "ragged"
    assert parity_compile.expected_exchange(c, "cpu", 8) == "padded"
    assert parity_compile.expected_exchange(c, "tpu", 1) == "-"  # one expert shard: no exchange
    ring = c.model_copy(update={"use_ring_of_experts": True})
    assert parity_compile.expected_exchange(ring, "tpu", 8) == "-"
    padded = c.model_copy(update={"a2a_impl": "padded"})
    assert parity_compile.expected_exchange(padded, "gpu", 8) == "padded"


def test_parse_layout_takes_the_target_platforms_exchange():
    assert parse_layout("sparse-ep8", backend="tpu").a2a_impl == "ragged"
    assert parse_layout("sparse-ep8", backend="gpu").a2a_impl == "ragged"
    assert parse_layout("sparse-ep8", backend="cpu").a2a_impl == "padded"
    assert parse_layout("sparse-ep8").a2a_impl == "padded"  # this process: XLA:CPU


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--steps", "3"], ["--steps"]),
        (["--impose-routing"], ["--impose-routing"]),
        (["--steps", "3", "--impose-routing"], ["--steps", "--impose-routing"]),
    ],
)
def test_compile_only_refuses_run_flags(flags, named, capsys):
    assert cli.main(["parity", "--compile-only", *flags, "model_name=deepseek3-tiny"]) == 2
    err = capsys.readouterr().err
    assert "--compile-only" in err and all(flag in err for flag in named)


def test_target_needs_compile_only(capsys):
    assert cli.main(["parity", "--target", "tpu:v5p-16", "model_name=deepseek3-tiny"]) == 2
    err = capsys.readouterr().err
    assert "--target=tpu:v5p-16" in err and "--compile-only" in err


def test_format_row_flags_a_wrong_exchange_and_compile_errors():
    row = {
        "layout": "sparse-ragged-ep8",
        "status": "yes",
        "a2a": "padded",
        "a2a_expected": "ragged",
        "peak_device_bytes": 3 * 2**20,
        "flops_ratio": None,
        "collectives": {"all-to-all": 4},
        "kernels": {},
        "seconds": 1.0,
    }
    line = parity_compile.format_row(row)
    assert "padded (expected ragged) FAIL" in line and "3.0 MiB" in line and "a2a 4" in line
    error = {"layout": "x", "status": "error", "error": "INTERNAL: a | b", "seconds": 2.0}
    assert "NO (error: INTERNAL: a / b)" in parity_compile.format_row(error)


def test_group_size_reads_the_three_spellings_of_replica_groups():
    assert parity_compile.group_size("x, replica_groups={{0,1,2,3},{4,5,6,7}}, y") == 4
    assert parity_compile.group_size("replica_groups={{0},{1},{2},{3}}, dimensions={0}") == 1
    attrs = "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, dimensions={1}"
    assert parity_compile.group_size(attrs) == 2
    attrs = "replica_groups=mesh['axis_0'=4,'axis_1'=2,'axis_2'=1] {'axis_0','axis_2'}, x"
    assert parity_compile.group_size(attrs) == 4
    assert parity_compile.group_size("replica_groups=[2,4]<=[8], dimensions={0}") == 4
    assert parity_compile.group_size("replica_groups={}, dimensions={0}") is None


def test_a_ragged_all_to_all_within_one_device_is_no_exchange():
    summary = {
        "collectives": {"ragged-all-to-all": 8},
        "padded_exchange": 0,
        "ragged_within_one_device": 8,
    }
    assert parity_compile.exchange_found(summary) == "-"


def test_first_line_of_a_compiler_error():
    error = RuntimeError(
        "UNKNOWN: <unknown>:0: error: Bounds of the window dimensions of updates must not "
        "exceed the bounds: \n<unknown>:0: note: see current operation: ..."
    )
    assert parity_compile.first_line(error) == (
        "UNKNOWN: Bounds of the window dimensions of updates must not exceed the bounds"
    )
