"""`steptime.groups`: the devices a collective names, in each form XLA prints, checked against
numpy expansions by hand and against the TPU compiler's own mesh-axes form."""

from __future__ import annotations

import pytest

from expertax import targets
from expertax.steptime import groups

needs_tpu = pytest.mark.skipif(
    not targets.compiler_available("tpu"), reason="the TPU compiler (expertax[tpu]) is missing"
)


@pytest.mark.parametrize(
    "attrs, expected",
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups={}, to_apply=%add", [list(range(8))]),
        ("channel_id=1, dimensions={0}", [list(range(8))]),
        # XLA's iota form: iota(prod(reshape)) reshaped, transposed, cut into groups
        ("replica_groups=[2,4]<=[8], dimensions={0}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=[2,4]<=[4,2]T(1,0), x", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ("replica_groups=[4,2]<=[2,2,2]T(0,2,1), x", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        # mesh axes: row-major over the axes, grouped over the listed ones
        (
            "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, d",
            [[0, 4], [1, 5], [2, 6], [3, 7]],
        ),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, d", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (
            "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1','axis_0'}, d",
            [[0, 4, 1, 5, 2, 6, 3, 7]],
        ),
        # a device order and a sub-axis (axis_0 of 4 split into 2 x 2; the group over the minor 2)
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) "
            "{'axis_0':(2)2}, dimensions={0}",
            [[0, 1], [2, 3], [4, 5], [6, 7]],
        ),
    ],
)
def test_replica_group_forms(attrs, expected):
    assert groups.replica_groups(attrs, 8) == expected


def test_source_target_pairs_and_unknown_forms():
    assert groups.source_target_pairs("source_target_pairs={{0,1},{1,2},{2,0}}, x") == [
        (0, 1),
        (1, 2),
        (2, 0),
    ]
    assert groups.source_target_pairs("channel_id=1") == []
    with pytest.raises(groups.GroupError, match="not in the mesh"):
        groups.replica_groups("replica_groups=mesh['a'=2,'b'=4] {'c'}, x", 8)
    with pytest.raises(groups.GroupError, match="unreadable"):
        groups.replica_groups("replica_groups=<<odd>>, x", 8)


@needs_tpu
def test_the_tpu_compilers_mesh_form_groups_the_mesh_axis_it_gathers():
    """GSPMD's all-gathers on a 2 x 4 mesh, printed by the TPU compiler in the mesh-axes form,
    group the devices that differ along the gathered mesh axis."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = targets.parse_target("tpu:v5p-16").devices()
    mesh = Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=NamedSharding(mesh, P("a", "b")))
    expect = {
        P(None, "b"): [[0, 4], [1, 5], [2, 6], [3, 7]],
        P("a", None): [[0, 1, 2, 3], [4, 5, 6, 7]],
    }
    for spec, want in expect.items():
        f = jax.jit(lambda v: v * 2, out_shardings=NamedSharding(mesh, spec))
        text = f.lower(x).compile().as_text()
        line = next(ln for ln in text.splitlines() if " all-gather(" in ln)
        assert groups.replica_groups(line, 8) == want, line[:200]


def test_an_instruction_printed_over_several_lines_is_read_whole():
    """A Pallas kernel's metadata may hold newlines (MaxText's megablox calls print their
    tiling on a line of its own): the lines after it belong to the instruction."""
    from expertax.planner.hlo import parse_hlo

    text = (
        "HloModule m, is_scheduled=true\n\nENTRY %main (a: bf16[8,8]) -> bf16[8,8] {\n"
        "  %a = bf16[8,8]{1,0} parameter(0)\n"
        '  %k = bf16[8,8]{1,0} custom-call(%a), custom_call_target="tpu_custom_call", '
        "frontend_attributes={kernel_metadata={\n"
        '"xprof_metadata":"{\\"tiling\\": 512}"\n'
        '}}, metadata={op_name="jit(train_step)/jit(gmm)/pallas_call"}\n'
        "  ROOT %r = bf16[8,8]{1,0} add(%k, %a)\n"
        "}\n"
    )
    m = parse_hlo(text)
    assert m.instructions["k"].op_name == "jit(train_step)/jit(gmm)/pallas_call"
    assert m.instructions["r"].operands == ("k", "a") and m.roots["main"] == "r"
