"""`planner.flops`: matmul FLOPs of a compiled program from its optimized HLO, loops multiplied.

The counting logic is tested on a small hand-written HLO (no compiler needed); the rest compiles
tiny programs for 8 TPU v5p or 8 H100 devices without the hardware (`jax.experimental.topologies`,
compile only), skipped where libtpu or the CUDA plugin is not installed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from expertax.planner import flops
from expertax.planner.flops import count_flops

# A GpuTargetConfig text proto: what XLA:GPU compiles for without a GPU.
H100 = """\
gpu_device_info {
  cuda_compute_capability { major: 9 minor: 0 }
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 85520809984
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

TARGETS = ["tpu", "gpu"]


@functools.cache
def _topology(target: str):
    from jax.experimental import topologies

    if target == "tpu":
        return topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2").devices
    return topologies.get_topology_desc(
        platform="cuda", target_config=H100, topology="1x1x8"
    ).devices


def target_devices(target: str):
    """8 devices of `target` ("tpu": TPU v5p 2x2x2, "gpu": H100) to compile for, or a skip."""
    pytest.importorskip("libtpu" if target == "tpu" else "jax_plugins.xla_cuda12")
    return _topology(target)


def mesh_of(target: str):
    devices = target_devices(target)
    return jax.make_mesh(
        (2, 4), ("a", "b"), devices=devices, axis_types=(jax.sharding.AxisType.Auto,) * 2
    )


def sds(mesh, shape, spec, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def compiled(f, *args):
    return jax.jit(f).lower(*args).compile()


def xw(target: str):
    """x [256, 512] rows over "a", w [512, 512] columns over "b": per device x @ w is
    [128, 512] @ [512, 128], 2 * 128 * 512 * 128 flops."""
    mesh = mesh_of(target)
    return sds(mesh, (256, 512), P("a", None)), sds(mesh, (512, 512), P(None, "b"))


MATMUL = 2 * 128 * 512 * 128


def layer(w):
    return lambda c, _: (jnp.tanh(c @ w), None)


# --- the logic, on a hand-written HLO ----------------------------------------------------------

HLO = """\
HloModule jit_f, entry_computation_layout={(bf16[64,32]{1,0})->bf16[64,16]{1,0}}

%fused_dot (param_0: bf16[64,32], param_1: bf16[32,16]) -> bf16[64,16] {
  %param_0 = bf16[64,32]{1,0} parameter(0)
  %param_1 = bf16[32,16]{1,0} parameter(1)
  ROOT %convolution.1 = bf16[64,16]{1,0} convolution(%param_0, %param_1), dim_labels=bf_io->bf
}

%inner_body (p.2: (s32[], bf16[64,32], bf16[32,16])) -> (s32[], bf16[64,32], bf16[32,16]) {
  %p.2 = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) parameter(0)
  %g.20 = bf16[64,32]{1,0} get-tuple-element(%p.2), index=1
  %g.21 = bf16[32,16]{1,0} get-tuple-element(%p.2), index=2
  %dot.3 = f32[64,16]{1,0} dot(%g.20, %g.21), lhs_contracting_dims={1}, rhs_contracting_dims={0},\
 metadata={op_name="jit(f)/while/body/attn/dot_general"}
  ROOT %t.2 = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) tuple(%p.2, %g.20, %g.21)
}

%inner_cond (p.3: (s32[], bf16[64,32], bf16[32,16])) -> pred[] {
  %p.3 = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) parameter(0)
  %g.30 = s32[] get-tuple-element(%p.3), index=0
  ROOT %lt.3 = pred[] compare(%g.30, %g.30), direction=LT
}

%fused_add (param_0.1: s32[]) -> s32[] {
  %param_0.1 = s32[] parameter(0)
  %constant.5 = s32[] constant(1)
  ROOT %add.5 = s32[] add(%param_0.1, %constant.5)
}

%wide.body (wide.param: (s32[], bf16[64,32], bf16[32,16])) -> (s32[], bf16[64,32], bf16[32,16]) {
  %wide.param = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) parameter(0)
  %g.10 = s32[] get-tuple-element(%wide.param), index=0
  %g.11 = bf16[64,32]{1,0} get-tuple-element(%wide.param), index=1
  %g.12 = bf16[32,16]{1,0} get-tuple-element(%wide.param), index=2
  %next = s32[] fusion(%g.10), kind=kLoop, calls=%fused_add
  %fusion.1 = bf16[64,16]{1,0} fusion(%g.11, %g.12), kind=kOutput, calls=%fused_dot,\
 metadata={op_name="jit(f)/while/body/transpose(jvp(moe))/dot_general"}
  %while.2 = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) while(%wide.param),\
 condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %t.1 = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) tuple(%next, %g.11, %g.12)
}

%wide.cond (wide.param.1: (s32[], bf16[64,32], bf16[32,16])) -> pred[] {
  %wide.param.1 = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) parameter(0)
  %g.13 = s32[] get-tuple-element(%wide.param.1), index=0
  %constant.10 = s32[] constant(10)
  ROOT %lt.1 = pred[] compare(%constant.10, %g.13), direction=GT
}

%dyn_body (p.4: (s32[], bf16[64,32], bf16[32,16])) -> (s32[], bf16[64,32], bf16[32,16]) {
  %p.4 = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) parameter(0)
  %g.40 = bf16[64,32]{1,0} get-tuple-element(%p.4), index=1
  %g.41 = bf16[32,16]{1,0} get-tuple-element(%p.4), index=2
  %dot.4 = f32[64,16]{1,0} dot(%g.40, %g.41), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t.4 = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) tuple(%p.4, %g.40, %g.41)
}

%dyn_cond (p.5: (s32[], bf16[64,32], bf16[32,16])) -> pred[] {
  %p.5 = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) parameter(0)
  %g.50 = s32[] get-tuple-element(%p.5), index=0
  %n.5 = s32[] custom-call(), custom_call_target="Dynamic"
  ROOT %lt.5 = pred[] compare(%g.50, %n.5), direction=LT
}

%branch_0 (b0: bf16[64,32]) -> f32[64,64] {
  %b0 = bf16[64,32]{1,0} parameter(0)
  ROOT %dot.6 = f32[64,64]{1,0} dot(%b0, %b0), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%branch_1 (b1: bf16[64,32]) -> f32[64,64] {
  %b1 = bf16[64,32]{1,0} parameter(0)
  %dot.7 = f32[64,64]{1,0} dot(%b1, %b1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %dot.8 = f32[64,64]{1,0} dot(%b1, %b1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

ENTRY %main (x: bf16[64,32]) -> bf16[64,16] {
  %x = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,16]{1,0} constant({...})
  %constant.0 = s32[] constant(2)
  %copy.0 = s32[] copy(%constant.0)
  %init = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) tuple(%copy.0, %x, %w)
  %while.1 = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) while(%init), condition=%wide.cond,\
 body=%wide.body, metadata={op_name="jit(f)/while"}
  %while.3 = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) while(%init), condition=%dyn_cond,\
 body=%dyn_body, metadata={op_name="jit(f)/while_loop"}
  %w3 = bf16[4,32,16]{2,1,0} constant({...})
  %sizes = s32[4]{0} constant({16, 16, 16, 16})
  %rd = bf16[64,16]{1,0} ragged-dot(%x, %w3, %sizes), lhs_contracting_dims={1},\
 rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}
  %pred = pred[] constant(true)
  %cond.1 = f32[64,64]{1,0} conditional(%pred, %x, %x), branch_computations={%branch_0, %branch_1}
  %gemm = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm",\
 backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],\
"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %kernel = bf16[64,16]{1,0} custom-call(%x, %w), custom_call_target="tpu_custom_call",\
 backend_config={"custom_call_config":{"body":"abc","cost_estimate":{"flops":"1000"}}}
  %opaque = bf16[64,16]{1,0} custom-call(%x, %w), custom_call_target="tpu_custom_call",\
 metadata={op_name="jit(f)/pallas_call"}
  ROOT %out = bf16[64,16]{1,0} get-tuple-element(%gemm), index=0
}
"""

MM = 2 * 64 * 32 * 16  # one [64, 32] @ [32, 16]


def test_hand_written_hlo():
    r = count_flops(HLO)
    # while.1: 2 .. 9 (10 > i), 8 trips of (the fused convolution + 3 x the inner dot)
    body = MM + 3 * MM
    # while.3: the bound is data, counted once; the conditional: its dearer branch (2 dots);
    # a ragged dot (its 64 rows, not 4 groups x 64); the cuBLAS gemm; the Mosaic kernel's own
    # cost estimate; the kernel without one: nothing
    rest = MM + MM + 2 * (2 * 64 * 32 * 64) + MM + 1000
    assert r.flops == 8 * body + rest
    assert r.flops_once == MM + MM + rest  # the inner loop's body once too
    loops = {lp.name: lp for lp in r.loops}
    assert {n: lp.trip_count for n, lp in loops.items()} == {
        "while.1": 8,
        "while.2": 3,
        "while.3": None,
    }
    assert loops["while.1"].op_name == "jit(f)/while" and loops["while.1"].body_flops == body
    assert [lp.name for lp in r.unknown_trip_counts] == ["while.3"]
    assert r.opaque == [("opaque", "tpu_custom_call", "jit(f)/pallas_call")]
    # the fused convolution has no op_name of its own: its fusion's
    assert r.by_op_name["jit(f)/while/body/transpose(jvp(moe))/dot_general"] == 8 * MM
    assert r.matching("moe") == 8 * MM
    assert r.matching("attn") == 24 * MM
    assert r.by_scope(3)["jit(f)/while/body"] == 32 * MM  # transpose(jvp(moe)) unwrapped
    assert r.by_scope(4)["jit(f)/while/body/moe"] == 8 * MM


def test_convolution_counts_only_real_input():
    """TPU writes a batched matmul [8, 256, 512] @ [8, 512, 128] as a convolution whose batch is
    a base-dilated spatial dimension: each output position meets one real input position."""
    conv = """\
ENTRY %main (a: bf16[8,256,512], b: bf16[8,512,128]) -> bf16[8,256,128] {
  %a = bf16[8,256,512]{2,1,0} parameter(0)
  %b = bf16[8,512,128]{2,1,0} parameter(1)
  ROOT %c = bf16[8,256,128]{2,1,0} convolution(%a, %b), window={size=8 stride=7 lhs_dilate=8},\
 dim_labels=0bf_0io->0bf
}
"""
    assert count_flops(conv).flops == 8 * 2 * 256 * 512 * 128
    # a 3x3 "SAME" convolution of a 4x4 image: 3*4-2 = 10 valid (output, tap) pairs per axis
    assert flops._valid_pairs(4, 3, 4, 1, 1, 1, 1) == 10


def _fp8_hopper_call(name, mp, g, scope):
    """A Mosaic GPU call of fp8_hopper's fprop kernel, as XLA:GPU prints it: [Mp, 256] from the
    padded e4m3 rows [Mp, 256] and `g` groups' weights [g, 256, 256]."""
    return (
        f"  %{name} = bf16[{mp},256]{{1,0}} custom-call(%t, %x, %s, %w, %ws), "
        f'custom_call_target="mosaic_gpu_v2", operand_layout_constraints={{s32[{mp // 64}]{{0}}, '
        f"f8e4m3fn[{mp},256]{{1,0}}, f32[2,{mp}]{{1,0}}, f8e4m3fn[{g},256,256]{{2,1,0}}, "
        f'f32[{g},2,2]{{2,1,0}}}}, metadata={{op_name="jit(f)/{scope}/mpmd_map"}}'
    )


@pytest.mark.parametrize(
    "mp, g, scope, rows",
    [
        # 512 rows in 4 groups, each padded by half a row tile on average
        (768, 4, "fp8_gmm_fprop/fp8_tile~64", 512 + 4 * 32),
        (1024, 4, "fp8_gmm_fprop/fp8_tile~128", 512 + 4 * 64),
        (1024, 4, "fp8_gmm_fprop", 512 + 4 * 64),  # no tile named: 128
        # one group (the dense linears): its rows exactly, Mp less one tile
        (576, 1, "fp8_fprop/fp8_tile~64", 512),
        (640, 1, "fp8_fprop/fp8_tile~128", 512),
        # balanced routing named (rows~R, as for the bfloat16 kernels): G ceil(R / T) tiles
        (768, 4, "fp8_gmm_fprop/rows~128/fp8_tile~64", 4 * 128),
        (768, 4, "fp8_gmm_fprop/rows~100/fp8_tile~64", 4 * 128),
        (1024, 4, "fp8_gmm_dgrad/rows~100/fp8_tile~128", 4 * 128),
        (768, 4, "fp8_gmm_fprop/rows~1000/fp8_tile~64", 768),  # at most the buffer
    ],
)
def test_fp8_hopper_kernel_counts_the_rows_of_its_row_tile(mp, g, scope, rows):
    """fp8_hopper's fprop/dgrad pads each group to whole row tiles (64 or 128 rows, named by the
    call's `fp8_tile~T` scope): counted at the rows plus half a tile per group of several, or
    at the tiles the balanced rows per group fill where the program names them (`rows~R`)."""
    hlo = "\n".join(
        [
            f"ENTRY %main (x: f8e4m3fn[{mp},256]) -> bf16[{mp},256] {{",
            f"  %x = f8e4m3fn[{mp},256]{{1,0}} parameter(0)",
            _fp8_hopper_call("k", mp, g, scope),
            "}",
        ]
    )
    r = count_flops(hlo)
    assert not r.opaque
    assert r.flops == 2 * rows * 256 * 256


# --- compiled programs ------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_matmul_is_2mkn_per_device(target):
    x, w = xw(target)
    assert count_flops(compiled(lambda x, w: x @ w, x, w).as_text()).flops == MATMUL


@pytest.mark.parametrize("target", TARGETS)
def test_scan_flops_proportional_to_length(target):
    x, w = xw(target)
    for n in (1, 3, 7, 16):
        f = lambda x, w, n=n: jax.lax.scan(layer(w), x, None, length=n)[0].sum()
        r = count_flops(compiled(f, x, w).as_text())
        assert (r.flops, r.flops_once) == (n * MATMUL, MATMUL), n
        assert [lp.trip_count for lp in r.loops] == ([n] if n > 1 else [])
        assert not r.unknown_trip_counts


@pytest.mark.parametrize("target", TARGETS)
def test_nested_unrolled_fori_and_remat_loops(target):
    x, w = xw(target)

    def nested(x, w):
        outer = lambda c, _: (jax.lax.scan(layer(w), c, None, length=3)[0], None)
        return jax.lax.scan(outer, x, None, length=5)[0].sum()

    def remat_grad(x, w):
        def loss(w):
            h = jax.lax.scan(jax.checkpoint(layer(w)), x, None, length=4)[0]
            return h.astype(jnp.float32).sum()

        return jax.grad(loss)(w)

    cases = {
        "nested": (nested, 15, [5, 3]),
        "unrolled": (lambda x, w: jax.lax.scan(layer(w), x, None, 7, unroll=2)[0].sum(), 7, [3]),
        "fori": (lambda x, w: jax.lax.fori_loop(2, 9, lambda i, c: c @ w, x).sum(), 7, [7]),
        # forward 4, then per step: the recomputed forward and the two gradient matmuls
        "remat_grad": (remat_grad, 16, [4, 4]),
    }
    for name, (f, layers, trips) in cases.items():
        r = count_flops(compiled(f, x, w).as_text())
        assert r.flops == layers * MATMUL, name
        assert sorted(lp.trip_count or 0 for lp in r.loops) == sorted(trips), name


@pytest.mark.parametrize("target", TARGETS)
def test_data_dependent_loop_is_counted_once_and_listed(target):
    x, w = xw(target)

    def f(x, w):
        n = (x[0, 0] > 0).astype(jnp.int32) + 3
        return jax.lax.fori_loop(0, n, lambda i, c: c @ w, x).sum()

    r = count_flops(compiled(f, x, w).as_text())
    assert r.flops == MATMUL
    assert len(r.unknown_trip_counts) == 1 and r.unknown_trip_counts[0].body_flops == MATMUL


def test_flops_once_matches_tpu_cost_analysis():
    """XLA's cost analysis counts each loop body once and adds elementwise work."""
    x, w = xw("tpu")

    def grad_scan(x, w):
        loss = lambda w: jax.lax.scan(jax.checkpoint(layer(w)), x, None, 4)[0].sum()
        return jax.grad(lambda w: loss(w).astype(jnp.float32))(w)

    programs = [
        lambda x, w: x @ w,
        lambda x, w: jax.lax.scan(layer(w), x, None, length=7)[0].sum(),
        grad_scan,
    ]
    for f in programs:
        c = compiled(f, x, w)
        r, xla = count_flops(c.as_text()), c.cost_analysis()["flops"]
        assert r.flops_once <= xla < 1.03 * r.flops_once


E, M, K, N = 8, 1024, 512, 256


def ragged(target):
    mesh = mesh_of(target)
    args = (sds(mesh, (M, K), P()), sds(mesh, (E, K, N), P()), sds(mesh, (E,), P(), jnp.int32))
    # Mosaic refuses the float32 contract precision that the test settings make the default
    dot = functools.partial(jax.lax.ragged_dot, precision=jax.lax.Precision.DEFAULT)
    return compiled(dot, *args)


def test_ragged_dot_on_tpu_counts_routed_rows():
    c = ragged("tpu")
    r = count_flops(c.as_text())
    assert r.flops == 2 * M * K * N == c.cost_analysis()["flops"]


def test_ragged_dot_on_gpu_is_dense_over_experts():
    """XLA:GPU expands ragged_dot to a matmul per expert over every row: E x the routed flops."""
    r = count_flops(ragged("gpu").as_text())
    assert r.flops > E / 2 * 2 * M * K * N


# --- attention kernels and causal loops ----------------------------------------------------------


def _attention_grad(impl: str, target: str, b=1, t=512, h=4, g=2, qd=64, vd=64):
    """The compiled forward + backward of one causal attention call on one device, and its
    causal (query, key) pairs."""
    from expertax import platform
    from expertax.nn.attention.kernel import attend

    devices = target_devices(target)[:1]
    mesh = jax.make_mesh((1,), ("a",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
    q = sds(mesh, (b, t, h, qd), P())
    k = sds(mesh, (b, t, g, qd), P())
    v = sds(mesh, (b, t, g, vd), P())

    def loss(q, k, v):
        return attend(q, k, v, scale=0.125, impl=impl).astype(jnp.float32).sum()

    with platform.use(target, devices[0]), jax.set_mesh(mesh):
        text = compiled(jax.grad(loss, argnums=(0, 1, 2)), q, k, v).as_text()
    pairs = b * h * t * (t + 1) // 2
    return count_flops(text), pairs


def test_splash_attention_kernels_are_counted():
    """Splash's forward (Q + V per pair), dq (2Q + V) and dk/dv (2Q + 2V) kernels, causal pairs;
    none left opaque. MLA's unequal head dims (q/k 96, v 64)."""
    r, pairs = _attention_grad("splash", "tpu", qd=96, vd=64)
    assert not r.opaque
    assert r.flops == 2 * pairs * (5 * 96 + 4 * 64)  # the program holds nothing else


def test_cudnn_attention_kernels_are_counted():
    """cuDNN's forward (Q + V per pair) and its one backward kernel (3Q + 2V), causal pairs."""
    pytest.importorskip("nvidia.cudnn")
    r, pairs = _attention_grad("cudnn", "gpu")
    assert not r.opaque
    assert r.flops == 2 * pairs * (4 * 64 + 3 * 64)


@pytest.mark.parametrize("target", TARGETS)
def test_blockwise_causal_loops_count_their_mean_trips(target):
    """The blockwise kernel's inner loops run to the diagonal (a trip count from the block
    index): each is counted at its mean over the blocks (`trips~N`), so the total is exact."""
    r, pairs = _attention_grad("blockwise", target, t=2048, qd=64, vd=64)
    assert not r.unknown_trip_counts and r.expected_trip_counts
    blocks = 4  # 2048 / 512: block pairs at or below the diagonal, whole blocks computed
    block_pairs = 4 * (blocks * (blocks + 1) // 2) * 512 * 512
    # forward 2 dots, backward 5, per computed pair of a block
    assert r.flops == 2 * block_pairs * (2 * 64 + 5 * 64)
