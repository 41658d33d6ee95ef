"""FLOPs of grouped-matmul kernel custom calls (planner/kernels.py), on hand-written HLO: the block
arithmetic, tokamax's op metadata, megablox's group metadata, the balanced and worst-case counts."""

from expertax.planner.flops import count_flops
from expertax.planner.kernels import GroupedKernel

M, K, N, G = 4096, 2048, 1024, 64


def kernel(impl="triton", op="gmm", block=128, aligned=False, rows=None, m=M, g=G):
    return GroupedKernel("k", "tokamax", impl, op, m, g, K, N, block, aligned, rows)


def test_worst_case_is_one_extra_block_per_group_boundary():
    # 32 blocks of 128 rows cover the buffer; 63 group boundaries can split 63 of them
    assert kernel().worst_flops == 2 * (32 + 63) * 128 * K * N
    # fewer rows than blocks + boundaries: 2 blocks + 63 boundaries, not 64 groups x 2 blocks
    assert kernel(m=256, g=64).worst_flops == 2 * (2 + 63) * 128 * K * N


def test_expected_blocks_at_balanced_rows():
    # 64 rows per group in 128-row blocks: one block per group, aligned or not (2x the rows)
    assert kernel(rows=64).expected_flops == 2 * 64 * 128 * K * N
    assert kernel(rows=64, aligned=True).expected_flops == 2 * 64 * 128 * K * N
    # 96 rows per group: Triton's blocks start at each group (one each); aligned 128-row
    # blocks are shared at group boundaries: every 4 groups (3 blocks) touch 1 + 2 + 2 + 1
    assert kernel(rows=96).expected_flops == 2 * 64 * 128 * K * N
    assert kernel(rows=96, aligned=True).expected_flops == 2 * (16 * 6) * 128 * K * N
    # 256 rows per group: exactly the routed rows
    assert kernel(rows=256).expected_flops == 2 * 64 * 256 * K * N
    # Triton's weight gradient runs one (masked) block for an empty group
    assert kernel(op="tgmm", block=32, rows=0).expected_flops == 2 * 64 * 32 * K * N
    assert kernel(rows=0, aligned=True).expected_flops == 0
    # counted at the expectation where named, else at the worst case
    assert kernel(rows=64).flops == kernel(rows=64).expected_flops
    assert kernel().flops == kernel().worst_flops


def _tokamax_call(name, out, lhs, rhs, dims, group, config, scope="rows~64"):
    op = (
        '{\\"op\\":{\\"__type\\":\\"tokamax._src.ops.ragged_dot.pallas_triton.PallasTritonRaggedDot'
        f'\\",\\"config\\":{config}}},\\"arguments\\":{{\\"group_sizes\\":\\"i32[{G}]\\",'
        f'\\"lhs\\":\\"bf16[{lhs}]\\",\\"rhs\\":\\"bf16[{rhs}]\\",'
        f'\\"ragged_dot_dimension_numbers\\":{{\\"dot_dimension_numbers\\":{dims},'
        f'\\"lhs_ragged_dimensions\\":[0],\\"rhs_group_dimensions\\":{group}}}}}}}'
    )
    return (
        f"  %{name} = bf16[{out}]{{1,0}} custom-call(%x, %w), "
        f'custom_call_target="__gpu$xla.gpu.triton", '
        f'metadata={{op_name="jit(f)/{scope}/tokamax:{op}/pallas_call"}}'
    )


def test_tokamax_calls_read_from_their_metadata():
    cfg = '{\\"block_m\\":128,\\"block_n\\":128,\\"block_k\\":32}'
    lines = [
        _tokamax_call(
            "fwd", f"{M},{N}", f"{M},{K}", f"{G},{K},{N}", "[[[1],[1]],[[],[]]]", "[0]", cfg
        ),
        _tokamax_call(
            "dw", f"{G},{K},{N}", f"{M},{K}", f"{M},{N}", "[[[0],[0]],[[],[]]]", "[]", cfg, "x"
        ),
        _tokamax_call("odd", "8,8", f"{M},{K}", f"{G},{K},{N}", "[[[1],[1]],[[],[]]]", "[0]", cfg),
    ]
    hlo = "\n".join(
        [
            f"ENTRY %main (x: bf16[{M},{K}], w: bf16[{G},{K},{N}]) -> bf16[{M},{N}] {{",
            f"  %x = bf16[{M},{K}]{{1,0}} parameter(0)",
            f"  %w = bf16[{G},{K},{N}]{{2,1,0}} parameter(1)",
            *lines,
            "}",
        ]
    )
    r = count_flops(hlo)
    kernels = {k.instruction: k for k in r.kernels}
    # the output shape that does not match the arguments is no grouped kernel: opaque
    assert set(kernels) == {"fwd", "dw"} and [o[0] for o in r.opaque] == ["odd"]
    fwd, dw = kernels["fwd"], kernels["dw"]
    assert (fwd.op, fwd.block, fwd.groups, fwd.expected_rows) == ("gmm", 128, G, 64)
    assert (dw.op, dw.block, dw.groups, dw.expected_rows) == ("tgmm", 32, G, None)
    # forward at 64 rows per group: one 128-row block each; the weight gradient unnamed: worst
    assert r.flops == 2 * 64 * 128 * K * N + dw.worst_flops
    assert r.worst_flops == fwd.worst_flops + dw.worst_flops


def test_megablox_tile_from_its_group_metadata():
    # 8 row tiles of 512 and 64 groups: tile lists of 8 + 64 - 1 = 71 entries
    hlo = f"""\
ENTRY %main (x: bf16[{M},{K}], w: bf16[{G},{K},{N}]) -> bf16[{M},{N}] {{
  %x = bf16[{M},{K}]{{1,0}} parameter(0)
  %w = bf16[{G},{K},{N}]{{2,1,0}} parameter(1)
  %n = s32[] parameter(2)
  %starts = s32[65]{{0}} parameter(3)
  %ids = s32[71]{{0}} parameter(4)
  %tiles = s32[71]{{0}} parameter(5)
  %off = s32[1]{{0}} parameter(6)
  ROOT %k = bf16[{M},{N}]{{1,0}} custom-call(%n, %starts, %ids, %tiles, %off, %x, %w),\
 custom_call_target="tpu_custom_call", metadata={{op_name="jit(f)/rows~512/jit(gmm)/pallas_call"}}
}}
"""
    r = count_flops(hlo)
    (k,) = r.kernels
    assert (k.library, k.op, k.block, k.groups, k.aligned) == ("megablox", "gmm", 512, G, True)
    # 64 groups of 512 rows would be 32768 rows; the buffer has 4096: each group's expected
    # blocks are counted as named (the caller's expectation), the worst case from the buffer
    assert r.flops == 2 * 64 * 512 * K * N and r.worst_flops == 2 * 71 * 512 * K * N
