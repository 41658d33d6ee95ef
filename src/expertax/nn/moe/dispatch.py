"""Dispatch tokens to experts, run the expert FFN, combine: the einsum and the sorted path.

Einsum (`capacity_einsum`, `sparse_matmul=false`): per sequence, a one-hot dispatch tensor
[B, T, E, C] and einsums; with `capacity_factor > 0` assignments past an expert's capacity C are
dropped and counted (priority: all first choices, then second choices, ...); `capacity_factor=-1`
sets C = T, dropless.
Sorted (`sparse`, `sparse_matmul=true`): sort the M = N*K assignments by expert, grouped matmuls
over the sorted rows, unsort, weighted combine. Dropless by construction. `dropped` is int32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.fp8 import experts as fp8_experts
from expertax.nn import activation
from expertax.nn.moe import bias as bias_mod
from expertax.nn.moe import routed
from expertax.nn.moe.bias import ExpertBias
from expertax.nn.moe.stash import Stash, run_ffn
from expertax.nn.moe.vma import varying_like
from expertax.parallel import remat


def expert_ffn_sorted(
    rows_MD,
    wi_0_EDF,
    wi_1_EDF,
    wo_EFD,
    group_sizes_E,
    c: Config,
    dtype,
    group_offset=None,
    stash: Stash | None = None,
    bias: ExpertBias | None = None,
):
    """The gated FFN (`activation.of(c)`) over rows sorted by expert, with grouped matmuls
    (local experts only if offset), and the experts' biases where given (bias.py: added to
    the gate, up and output rows by each row's expert).

    Returns (y [M, D], stash): with a paged stash (moe/stash.py) the stashed names' values are
    written to it, or, in its read mode, taken from it instead of computed.
    """
    # the layer's products, plain or under the fp8 recipe traced now (fp8/experts.py), on the
    # local shapes: D and the local F
    products = fp8_experts.products(
        c, dtype, group_sizes_E, group_offset, rows_MD.shape[1], wi_0_EDF.shape[2]
    )

    def ffn(given):
        gate = products.project(rows_MD, wi_0_EDF.astype(dtype), remat.MOE_MLPWI_0, given)
        up = products.project(rows_MD, wi_1_EDF.astype(dtype), remat.MOE_MLPWI_1, given)
        values = {remat.MOE_MLPWI_0: gate, remat.MOE_MLPWI_1: up}
        if bias is not None:  # the values kept are the matmuls' (a stash gives them back)
            ids_M = bias_mod.row_experts(group_sizes_E, rows_MD.shape[0], group_offset)
            gate = gate + bias_mod.rows(bias.gate_EF, ids_M, dtype)
            up = up + bias_mod.rows(bias.up_EF, ids_M, dtype)
        # what the stash holds of gate and up where it is not their values (fp8: the
        # activation's quantized inputs)
        y, held = products.glu(gate, up, wo_EFD.astype(dtype), given)
        values.update(held)
        values[remat.MOE_MLPWO] = y
        if bias is not None:
            y = y + bias_mod.rows(bias.down_ED, ids_M, dtype)
        return y, values

    m = rows_MD.shape[0]
    return run_ffn(stash, m, group_sizes_E, group_offset, wi_0_EDF.shape[0], ffn)


def permute(x_ND, experts_NK, num_experts):
    """Rows sorted by expert: (rows [M, D], sort order [M], group sizes [E]), M = N*K."""
    k = experts_NK.shape[1]
    flat = experts_NK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = take_rows(x_ND, order, k)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return rows, order, sizes


def unpermute_combine(y_sorted, order, weights_NK, c: Config, dtype):
    """Undo the sort and take the weighted sum of each token's K expert outputs, in `dtype`.

    The unsorted rows stay in `dtype`; with `float32_weight_sum` only the [N, D] accumulator is
    float32 (one expert slot at a time: no float32 copy of the N*K rows, forward or backward).
    """
    n, k = weights_NK.shape
    y_NKD = take_rows(y_sorted, inverse_permutation(order), 1).reshape(n, k, -1)
    acc = jnp.float32 if c.float32_weight_sum else dtype
    w_NK = weights_NK.astype(acc)
    out_ND = y_NKD[:, 0].astype(acc) * w_NK[:, 0:1]
    for j in range(1, k):
        out_ND = out_ND + y_NKD[:, j].astype(acc) * w_NK[:, j : j + 1]
    return out_ND.astype(dtype)


def inverse_permutation(order_M):
    """`inv` with `inv[order[m]] = m` (an int scatter of M indices, no row data)."""
    m = order_M.shape[0]
    iota = jnp.arange(m, dtype=order_M.dtype)
    return varying_like(jnp.zeros_like(order_M), order_M).at[order_M].set(iota)


def take_rows(x_ND, order_M, k: int):
    """`x[order // k]` for a permutation `order` of the N*k (row, copy) slots: [N*k, D].

    Both directions are gathers: the gradient of row n is the sum of the output rows of its k
    slots, `dy[inv].reshape(N, k, D).sum(1)` with `inv` the inverse permutation, where
    autodiff of `jnp.take` would scatter-add (XLA:CPU expands a scatter of rows into a
    sort-based loop: ~20 ms of a Mixtral-like step, issue 15).
    """
    args = tuple(varying_like(a, x_ND, order_M) for a in (x_ND, order_M.astype(jnp.int32)))
    return _take_rows(*args, k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take_rows(x_ND, order_M, k):
    return jnp.take(x_ND, order_M // k, axis=0)


def _take_rows_fwd(x_ND, order_M, k):
    return _take_rows(x_ND, order_M, k), order_M


def _take_rows_bwd(k, order_M, dy_MD):
    g_MD = jnp.take(dy_MD, inverse_permutation(order_M), axis=0)
    # Added slot by slot, not `.sum(axis=1)`: jnp.sum accumulates bfloat16 in float32, which
    # would put float32 [N, D] rows into the bfloat16 path (tests/distributed/test_ep.py).
    g_NKD = g_MD.reshape(-1, k, g_MD.shape[1])
    dx_ND = g_NKD[:, 0]
    for j in range(1, k):
        dx_ND = dx_ND + g_NKD[:, j]
    return dx_ND, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def sparse(x_ND, routing, p, c: Config, dtype, stash: Stash | None = None):
    """The one-device sorted path: (out [N, D], dropped = 0, stash).

    With the fused routed FFN (routed.py) the sorted rows are never a buffer: the grouped loops
    gather each tile's tokens by `order // K` and scatter-add their weighted outputs.
    """
    if routed.use_fused(c):
        n, k = routing.weights_NK.shape
        flat = routing.experts_NK.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.zeros((c.num_experts,), jnp.int32).at[flat].add(1)
        weight_M = take_rows(routing.weights_NK.reshape(-1, 1), order, 1)[:, 0]
        w = (p.wi_0, p.wi_1, p.wo)
        out, stash = routed.routed_ffn(
            x_ND, order // k, weight_M, w, sizes, c, dtype, n=n, stash=stash
        )
        return out.astype(dtype), jnp.int32(0), stash
    rows, order, sizes = permute(x_ND, routing.experts_NK, c.num_experts)
    y, stash = expert_ffn_sorted(
        rows, p.wi_0, p.wi_1, p.wo, sizes, c, dtype, stash=stash, bias=bias_mod.of(p)
    )
    return unpermute_combine(y, order, routing.weights_NK, c, dtype), jnp.int32(0), stash


def capacity(c: Config, seq_len: int) -> int:
    if c.capacity_factor == -1:
        return seq_len
    per_expert = seq_len * c.num_experts_per_tok / c.num_experts * c.capacity_factor
    return max(1, min(seq_len, math.ceil(per_expert)))


def capacity_einsum(x_BTD, experts_BTK, weights_BTK, p, c: Config, dtype):
    """One-hot einsum dispatch per sequence: (out [B, T, D], dropped assignments, int32)."""
    b, t, k = experts_BTK.shape
    cap = capacity(c, t)
    onehot_BKTE = jax.nn.one_hot(experts_BTK.transpose(0, 2, 1), c.num_experts, dtype=jnp.int32)
    flat = onehot_BKTE.reshape(b, k * t, c.num_experts)
    position = (jnp.cumsum(flat, axis=1) - 1).reshape(b, k, t, c.num_experts)
    keep = (onehot_BKTE == 1) & (position < cap)
    slot_BKTEC = jax.nn.one_hot(jnp.where(keep, position, -1), cap, dtype=dtype)
    dispatch_BTEC = slot_BKTEC.sum(1)
    w = weights_BTK.transpose(0, 2, 1)[..., None, None]
    combine_BTEC = (slot_BKTEC.astype(jnp.float32) * w).sum(1)
    x_EBCD = jnp.einsum("btd,btec->ebcd", x_BTD, dispatch_BTEC)
    gate = remat.tag(jnp.einsum("ebcd,edf->ebcf", x_EBCD, p.wi_0.astype(dtype)), remat.MOE_MLPWI_0)
    up = remat.tag(jnp.einsum("ebcd,edf->ebcf", x_EBCD, p.wi_1.astype(dtype)), remat.MOE_MLPWI_1)
    if (b := bias_mod.of(p)) is not None:  # an empty slot's output has no combine weight
        gate = gate + b.gate_EF.astype(dtype)[:, None, None]
        up = up + b.up_EF.astype(dtype)[:, None, None]
    y = jnp.einsum("ebcf,efd->ebcd", activation.of(c)(gate, up), p.wo.astype(dtype))
    y = remat.tag(y, remat.MOE_MLPWO)
    if b is not None:
        y = y + b.down_ED.astype(dtype)[:, None, None]
    # The expert outputs stay in `dtype`; the float32 combine weights set the accumulation
    # (a mixed-dtype dot_general: no float32 copy of y [E, B, C, D]).
    acc = jnp.float32 if c.float32_weight_sum else dtype
    out_BDT = jax.lax.dot_general(
        y, combine_BTEC.astype(acc), (((0, 2), (2, 3)), ((1,), (0,))), preferred_element_type=acc
    )
    out = out_BDT.transpose(0, 2, 1).astype(dtype)
    dropped = jnp.sum(onehot_BKTE) - jnp.sum(keep)
    return out, dropped.astype(jnp.int32)
