"""`steptime.collectives` and `steptime.topology`: each collective's bytes per device, the
placement of its groups on the torus or the GPU nodes, and its time by the stated formulas,
checked by hand on small hand-written instructions."""

from __future__ import annotations

import math

import pytest
from tests.unit.steptime.hlo_text import module

from expertax import targets
from expertax.planner.hlo import parse_hlo
from expertax.steptime import collectives, topology
from expertax.steptime.links import LINKS, torus_wraps

MB = 8 * 1024 * 1024 * 2  # bytes of bf16[8192,1024] (the all-gathers' output)


def _one(line: str, spec: str, operand="bf16[1024,1024]{1,0}"):
    m = parse_hlo(module([f"%a = {operand} parameter(0)", line]))
    p = topology.default_placement(targets.parse_target(spec))
    ins = next(i for i in m.instructions.values() if i.opcode != "parameter")
    return collectives.collective(m, ins, p), p


def test_torus_wraparound_follows_the_slice():
    assert torus_wraps("v5p", (8, 8, 8)) == (True, True, True)
    assert torus_wraps("v5p", (4, 4, 8)) == (True, True, True)
    assert torus_wraps("v5p", (2, 2, 2)) == (False, False, False)
    assert torus_wraps("v5p", (2, 2, 4)) == (False, False, False)  # not whole cubes
    assert torus_wraps("v6e", (8, 16)) == (False, True)
    assert torus_wraps("v6e", (16, 16)) == (True, True)


def test_default_placement_numbers_chips_x_fastest_and_gpus_by_node():
    p = topology.default_placement(targets.parse_target("tpu:v5p-1024"))  # 8x8x8
    assert p.coords[0] == (0, 0, 0) and p.coords[1] == (1, 0, 0) and p.coords[8] == (0, 1, 0)
    assert p.coords[64] == (0, 0, 1) and p.wraps == (True, True, True)
    g = topology.default_placement(targets.parse_target("gpu:h100x32"))
    assert g.coords[7] == (0, 7) and g.coords[8] == (1, 0) and g.grid == (4, 8)
    assert topology.hops(p, 0, 7) == 1  # around the ring
    assert topology.hops(p, 0, 4) == 4
    assert topology.hops(p, 0, 9) == 2


def test_all_gather_on_a_torus_ring_and_on_a_line():
    """Bytes per device = the gathered output; a ring of 8 chips along x (v5p-1024 wraps) uses
    both neighbours: B (n-1)/n / 2W; the same group on v5p-16's 2x2x2 (no wraparound) spans
    three axes as lines: B (n-1)/n / 3W."""
    w = LINKS["v5p"].ici_bytes_per_s * LINKS["v5p"].link_share
    alpha = LINKS["v5p"].latency_s
    ag = (
        "%g = bf16[8192,1024]{1,0} all-gather(%a), channel_id=1, "
        "replica_groups=[64,8]<=[512], dimensions={0}, use_global_device_ids=true"
    )
    c, _ = _one(ag, "tpu:v5p-1024")
    assert c.kind == "all-gather" and c.bytes == MB and c.group_size == 8
    assert c.span == "torus x8(ring)"
    assert c.seconds == pytest.approx(alpha + MB * 7 / 8 / (2 * w))
    c, _ = _one(ag.replace("[64,8]<=[512]", "{{0,1,2,3,4,5,6,7}}"), "tpu:v5p-16")
    assert c.span == "torus x2 y2 z2"
    assert c.seconds == pytest.approx(alpha + MB * 7 / 8 / (3 * w))


def test_reduce_scatter_all_reduce_and_all_to_all_on_the_torus():
    w = LINKS["v5p"].ici_bytes_per_s * LINKS["v5p"].link_share
    alpha = LINKS["v5p"].latency_s
    b = 1024 * 1024 * 2
    groups = "replica_groups=[64,8]<=[512]"
    ar = f"%r = bf16[1024,1024]{{1,0}} all-reduce(%a), channel_id=1, {groups}, to_apply=%add"
    c, _ = _one(ar, "tpu:v5p-1024")
    assert c.bytes == b and c.seconds == pytest.approx(alpha + 2 * b * 7 / 8 / (2 * w))
    rs = f"%r = bf16[128,1024]{{1,0}} reduce-scatter(%a), channel_id=1, {groups}, dimensions={{0}}"
    c, _ = _one(rs, "tpu:v5p-1024")
    assert c.bytes == b and c.seconds == pytest.approx(alpha + b * 7 / 8 / (2 * w))
    # all-to-all among 8 on a ring, shortest routes, distance 4 split both ways: the most
    # loaded link direction carries (1 + 2 + 3 + 4 / 2) / 8 of a device's bytes
    a2a = f"%t = bf16[1024,1024]{{1,0}} all-to-all(%a), channel_id=1, {groups}, dimensions={{0}}"
    c, _ = _one(a2a, "tpu:v5p-1024")
    assert c.seconds == pytest.approx(alpha + b * (3 * 4 / 2 + 8 / 4) / 8 / w)
    # on a line of 4 the middle link carries 2 x 2 of the 4 shares: max over cuts k (e - k) / e
    assert collectives._line_load(4) == pytest.approx(4 / 4)
    assert collectives._ring_load(2) == pytest.approx(1 / 4)


def test_collective_permute_costs_its_longest_route():
    w = LINKS["v5p"].ici_bytes_per_s * LINKS["v5p"].link_share
    line = (
        "%p = bf16[1024,1024]{1,0} collective-permute(%a), channel_id=1, "
        "source_target_pairs={{0,2},{2,0},{1,1}}"
    )
    c, _ = _one(line, "tpu:v5p-1024")
    assert c.kind == "collective-permute" and c.span == "2 link(s)"
    assert c.seconds == pytest.approx(LINKS["v5p"].latency_s + 2 * 1024 * 1024 * 2 / w)


def test_gpu_collectives_inside_a_node_and_across_nodes():
    h = LINKS["h100"]
    nvl, nic = h.nvlink_bytes_per_s * h.link_share, h.nic_bytes_per_s * h.nic_share
    b = 1024 * 1024 * 2
    ar = "%r = bf16[1024,1024]{1,0} all-reduce(%a), channel_id=1, replica_groups={}, to_apply=%x"
    c, _ = _one(ar, "gpu:h100x8")  # a whole node: NVLink SHARP
    assert c.span == "8 GPU NVLink" and c.model == "NVLink SHARP"
    assert c.seconds == pytest.approx(h.latency_s + 2 * b * 7 / 8 / h.allreduce_bytes_per_s)
    half = ar.replace("replica_groups={}", "replica_groups={{0,1,2,3},{4,5,6,7}}")
    c, _ = _one(half, "gpu:h100x8")
    assert c.seconds == pytest.approx(h.latency_s + 2 * b * 3 / 4 / nvl)
    # 32 GPUs over 4 nodes: rings one per card, 8 cards a node
    ag = (
        "%g = bf16[32768,1024]{1,0} all-gather(%a), channel_id=1, replica_groups=[1,32]<=[32], "
        "dimensions={0}, use_global_device_ids=true"
    )
    c, _ = _one(ag, "gpu:h100x32")
    assert c.span == "4 nodes x 8 GPUs" and c.bytes == 32 * b
    assert c.seconds == pytest.approx(h.network_latency_s + 32 * b * 31 / 32 / min(8 * nic, nvl))
    # all-to-all across 4 nodes: each card sends the 24 of 32 shares that leave the node
    a2a = ag.replace("bf16[32768,1024]{1,0} all-gather", "bf16[1024,1024]{1,0} all-to-all")
    c, _ = _one(a2a, "gpu:h100x32")
    assert c.seconds == pytest.approx(h.network_latency_s + b * 24 / 32 / nic)
    # a data-parallel group: one GPU per node, its own card
    dp = ag.replace("[1,32]<=[32]", "[8,4]<=[4,8]T(1,0)").replace("32768", "4096")
    c, _ = _one(dp, "gpu:h100x32")
    assert c.span == "4 nodes x 1 GPUs" and c.group_size == 4
    assert c.seconds == pytest.approx(h.network_latency_s + 4 * b * 3 / 4 / nic)


def test_ragged_all_to_all_moves_the_smaller_buffer_and_unknown_devices_are_refused():
    """Dispatch: the routed rows (1024) into a worst-case receive buffer (4096); combine: back
    from that buffer: the rows moved are at most the smaller of the two either way."""
    line = (
        "%r = bf16[4096,1024]{1,0} ragged-all-to-all(%a, %a), channel_id=1, "
        "replica_groups={{0,1,2,3},{4,5,6,7}}"
    )
    c, _ = _one(line, "gpu:h100x8")
    assert c.kind == "ragged-all-to-all" and c.bytes == 1024 * 1024 * 2
    back = line.replace("bf16[4096,1024]{1,0} ragged", "bf16[1024,1024]{1,0} ragged")
    c, _ = _one(back, "gpu:h100x8", operand="bf16[4096,1024]{1,0}")
    assert c.bytes == 1024 * 1024 * 2
    too_many = line.replace("{{0,1,2,3},{4,5,6,7}}", "{{0,9}}")
    with pytest.raises(ValueError, match="past the target"):
        _one(too_many, "gpu:h100x8")


def test_array_bytes_of_shapes():
    assert collectives.array_bytes("bf16[2,3]{1,0}") == 12
    assert collectives.array_bytes("(f32[4]{0}, f8e4m3fn[8]{0}, u32[]{:S(2)})") == 16 + 8 + 4
    assert collectives.array_bytes("s4[6]") == 3
    assert math.isclose(collectives.array_bytes("pred[]"), 1)
