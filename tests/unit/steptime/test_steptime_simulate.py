"""`steptime.simulate` on hand-written schedules: a synchronous collective is exposed whole, an
asynchronous one only where the compute between its start and done does not cover it, a loop
counts its body trip-count times, a fused collective overlaps its fusion's compute, a host
copy runs on the host link; and `steptime.report`'s parts add up to the step."""

from __future__ import annotations

import pytest
from tests.unit.steptime.hlo_text import PARAM, W, all_gather, done, dot, module

from expertax import targets
from expertax.planner.hlo import parse_hlo
from expertax.steptime import topology
from expertax.steptime.links import LINKS
from expertax.steptime.report import estimate
from expertax.steptime.simulate import Simulator

GROUP = "{{0,1,2,3,4,5,6,7}}"
H100 = LINKS["h100"]
DOT = 2 * 1024**3 / (H100.peak * H100.matmul_share)  # one 1024^3 bf16 dot on an H100
AG = H100.latency_s + 8192 * 1024 * 2 * 7 / 8 / (H100.nvlink_bytes_per_s * H100.link_share)


def _run(text: str, spec: str = "gpu:h100x8", host: float = 0.0):
    m = parse_hlo(text)
    sim = Simulator(m, topology.default_placement(targets.parse_target(spec)), host)
    return sim, sim.run(m.entry)


def test_a_dot_costs_its_flops_at_the_gemm_share():
    _, seg = _run(module([PARAM, W, dot("d")]))
    assert seg.flops == 2 * 1024**3
    assert seg.seconds == pytest.approx(DOT) and seg.matmul_seconds == pytest.approx(DOT)


def test_a_synchronous_collective_is_exposed_whole():
    _, seg = _run(module([PARAM, W, all_gather("g", "a", GROUP), dot("d")]))
    (c,) = seg.comm.values()
    assert c.seconds == pytest.approx(AG) and c.exposed_seconds == pytest.approx(AG)
    assert seg.seconds == pytest.approx(AG + DOT)


@pytest.mark.parametrize("dots", [1, 8])
def test_an_asynchronous_collective_is_exposed_where_compute_does_not_cover_it(dots):
    between = [dot(f"d{i}") for i in range(dots)]
    text = module([PARAM, W, all_gather("s", "a", GROUP, start=True), *between, done("g", "s")])
    _, seg = _run(text)
    (c,) = seg.comm.values()
    exposed = max(0.0, AG - dots * DOT)
    assert c.exposed_seconds == pytest.approx(exposed, abs=1e-12)
    assert seg.seconds == pytest.approx(dots * DOT + exposed)


def test_a_start_marked_synchronous_is_exposed_whole():
    text = module(
        [PARAM, W, all_gather("s", "a", GROUP, start=True, sync=True), dot("d0"), done("g", "s")]
    )
    _, seg = _run(text)
    (c,) = seg.comm.values()
    assert c.exposed_seconds == pytest.approx(AG)


def _loop_module(metadata: str = "") -> str:
    """A loop of 6 known trips whose body is a dot and an all-gather."""
    body = [
        "%p = (s32[], bf16[1024,1024]) parameter(0)",
        "%i = s32[] get-tuple-element(%p), index=0",
        "%a = bf16[1024,1024]{1,0} get-tuple-element(%p), index=1",
        "%w = bf16[1024,1024]{1,0} constant({...})",
        dot("d"),
        all_gather("g", "d", GROUP),
        "%one = s32[] constant(1)",
        "%n = s32[] add(%i, %one)",
        "ROOT %t = (s32[], bf16[1024,1024]) tuple(%n, %d)",
    ]
    cond = [
        "%p = (s32[], bf16[1024,1024]) parameter(0)",
        "%i = s32[] get-tuple-element(%p), index=0",
        "%k = s32[] constant(6)",
        "ROOT %lt = pred[] compare(%i, %k), direction=LT",
    ]
    entry = [
        PARAM,
        "%zero = s32[] constant(0)",
        "%init = (s32[], bf16[1024,1024]) tuple(%zero, %a)",
        "%loop = (s32[], bf16[1024,1024]) while(%init), condition=%cond, body=%body, "
        'backend_config={"known_trip_count":{"n":"6"}}' + metadata,
    ]
    return module(entry, ("body", body), ("cond", cond))


def test_a_loop_runs_its_body_trip_count_times():
    sim, seg = _run(_loop_module())
    (lp,) = sim.loops
    assert lp.trips == 6 and lp.how == "read"
    assert seg.flops == 6 * 2 * 1024**3
    (c,) = seg.comm.values()
    assert c.count == 6 and c.exposed_seconds == pytest.approx(6 * AG)
    assert seg.seconds == pytest.approx(6 * (DOT + AG), rel=1e-3)


def test_a_pipeline_loops_idle_iterations_are_its_bubble():
    """The pipeline's loop carries `idle~N` (models/pipeline.py): N of its trips are each
    stage's bubble, reported apart and inside the other parts; a loop nested in the pipeline's
    body (the scope above its parent's body) is not counted again."""
    from expertax import scopes
    from expertax.steptime.report import format_steptime
    from expertax.steptime.simulate import _idle_iterations

    label = scopes.IDLE.label(3)
    sim, seg = _run(_loop_module(f', metadata={{op_name="jit(step)/{label}/while"}}'))
    assert seg.bubble_seconds == pytest.approx(3 * (DOT + AG), rel=1e-3)
    assert seg.bubble_seconds == pytest.approx(seg.seconds / 2, rel=1e-3)  # 3 of 6 trips
    assert _idle_iterations(f"jit(step)/{label}/while/body/layers/while") == 0
    assert _idle_iterations("jit(step)/while") == 0
    p = topology.default_placement(targets.parse_target("gpu:h100x8"))
    r = estimate(_loop_module(f', metadata={{op_name="jit(step)/{label}/while"}}'), p)
    assert r["bubble_seconds"] == pytest.approx(seg.bubble_seconds)
    assert "pipeline bubble" in format_steptime(r)
    assert "pipeline bubble" not in format_steptime(estimate(_loop_module(), p))


def test_a_fused_collective_overlaps_its_fusions_compute():
    fused = [
        "%x = bf16[1024,1024]{1,0} parameter(0)",
        "%y = bf16[1024,1024]{1,0} parameter(1)",
        dot("d", "x", "y"),
        all_gather("g", "x", GROUP),
        "ROOT %t = (bf16[1024,1024], bf16[8192,1024]) tuple(%d, %g)",
    ]
    entry = [
        PARAM,
        W,
        "%f = (bf16[1024,1024]{1,0}, bf16[8192,1024]{1,0}) fusion(%a, %w), kind=kCustom, "
        "calls=%async_collective_fusion",
    ]
    _, seg = _run(module(entry, ("async_collective_fusion", fused)))
    (c,) = seg.comm.values()
    compute = seg.matmul_seconds + seg.memory_seconds
    assert c.exposed_seconds == pytest.approx(max(0.0, AG - compute))
    assert seg.seconds == pytest.approx(max(AG, compute))


def test_a_host_copy_runs_on_the_host_link():
    entry = [
        PARAM,
        W,
        "%cs = (bf16[1024,1024]{1,0:S(5)}, bf16[1024,1024]{1,0}, u32[]) copy-start(%a)",
        dot("d"),
        "%cd = bf16[1024,1024]{1,0:S(5)} copy-done(%cs)",
    ]
    rate = 32e9
    _, seg = _run(module(entry), host=rate)
    move = 1024 * 1024 * 2 / rate
    assert {lane for lane, *_ in seg.events} == {"compute", "host"}  # lanes the plot draws
    assert seg.host_seconds == pytest.approx(move)
    assert seg.host_exposed_seconds == pytest.approx(max(0.0, move - DOT))


def test_the_reports_parts_add_up_and_say_how_they_were_found():
    text = module(
        [PARAM, W, all_gather("s", "a", GROUP, start=True), dot("d0"), done("g", "s"), dot("d1")]
    )
    p = topology.default_placement(targets.parse_target("gpu:h100x8"), (("fsdp", 8),))
    r = estimate(text, p, model_flops=4 * 1024**3, tokens=1024, target="gpu:h100x8")
    assert r["method"] == "predicted from the compiled program, not measured"
    parts = r["compute_seconds"] + r["exposed_communication_seconds"] + r["exposed_host_seconds"]
    assert r["seconds"] == pytest.approx(parts)
    assert r["mfu"] == pytest.approx(4 * 1024**3 / (r["seconds"] * H100.peak))
    assert r["tokens_per_s_per_device"] == pytest.approx(1024 / r["seconds"])
    (c,) = r["communication"]
    assert c["mesh_axes"] == ["fsdp"] and c["kind"] == "all-gather"


def test_an_in_place_scatter_moves_its_updates_not_its_buffer():
    """A fusion adding rows into a large buffer in place (the MoE's combine) reads and writes
    the rows, not the whole buffer."""
    fused = [
        "%buf = bf16[65536,1024]{1,0} parameter(0)",
        "%idx = s32[1024,1]{1,0} parameter(1)",
        "%upd = bf16[1024,1024]{1,0} parameter(2)",
        "ROOT %s = bf16[65536,1024]{1,0} scatter(%buf, %idx, %upd), update_window_dims={1}, "
        "inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, "
        "to_apply=%add",
    ]
    entry = [
        "%b = bf16[65536,1024]{1,0} parameter(0)",
        "%i = s32[1024,1]{1,0} parameter(1)",
        "%u = bf16[1024,1024]{1,0} parameter(2)",
        "%f = bf16[65536,1024]{1,0} fusion(%b, %i, %u), kind=kLoop, calls=%scatter_fusion",
    ]
    sim, seg = _run(module(entry, ("scatter_fusion", fused)))
    moved = sim.costs.memo["f"].bytes
    rows = 1024 * 1024 * 2
    assert rows * 2 <= moved <= rows * 2 + 1024 * 4 + rows  # updates read and written, indices
