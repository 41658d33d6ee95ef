"""Splash attention: the Pallas TPU flash-attention kernel of `jax.experimental.pallas.ops.tpu.
splash_attention`, causal, with packed-document segment ids, GQA and MLA's unequal head dims.

The kernel works on one sequence, heads first ([H, T, Q] queries, [G, S, Q] keys, [G, S, O]
values); this wrapper transposes each sequence to that layout, `vmap`s over the batch and
transposes the [H, T, O] result back. What it takes, and what the wrapper does about it:
- Causal mask: a `CausalMask` per head, turned by the library, at trace time and in NumPy, into a
  map of which [block, block] tiles are empty, partial or full; empty tiles (above the diagonal)
  are skipped in the forward and both backward kernels, so about half the tile pairs of a long
  sequence are never computed. No [T, S] mask exists anywhere. A sliding window of W positions
  (mask.py) is a `LocalMask` with W - 1 keys to the left and none to the right: the tiles wholly
  before the window are skipped as well.
- Segment ids: `SegmentIds(q=[T], kv=[S])` int32 per sequence, compared inside each tile; they
  never form a [T, S] matrix either.
- GQA: keys and values with G heads, G dividing H (query head h reads kv head h // (H / G)), so
  keys are never repeated; MLA passes G = H.
- Head dims: query/key dim Q and value dim O may differ (MLA's 192 and 128, DeepSeek-V3): the
  kernel has its own value head dim, so nothing is padded. Mosaic compiled Q, O in {20, 32, 48,
  64, 96, 128, 192} for v5p (benchmarks/attention_targets.py); TPU memory tiles pad a minor dim
  below a multiple of 128 in any case (192 is stored as 256), kernel or not.
- Sequence length: the block sizes (rows of queries and keys per tile) must be multiples of 128
  that divide the length. The length is padded to a multiple of 128 and the block is the largest
  of 512, 256, 128 that divides it (or the whole padded length when it is at most 512). Padded
  keys come after every real query, so causality already hides them; padded query rows are
  dropped. A length that is a multiple of 128 costs nothing.
- Softmax scale: the kernel has none; queries are multiplied by it first, in their own dtype
  (one more rounding of q in bfloat16 than `attend_dot`, which scales the float32 scores).
- Numerics: scores, softmax statistics and accumulators in float32 inside the kernel; output in
  the query dtype.

Under a mesh (`jax.set_mesh` and a rules table), a Pallas kernel is opaque to XLA's partitioner,
so the call runs in a `shard_map`: batch and heads split as the rules say (`batch`, `act_heads`,
the same split for query and kv heads so that each device keeps whole GQA groups) and the length
whole (a length split by the rules is all-gathered at the boundary).

Under context parallelism (`attend_context`, called by context.py inside its shard_map) each
device holds its own rows of the queries, in the load-balanced order (chunks i and 2cp-1-i of
2cp) or contiguous, against the whole sequence's keys in sequence order. The mask is built once
for the whole sequence: a causal (or sliding-window) mask whose query rows carry their true
positions (`q_sequence`, the permutation of the load-balanced layout), made with
`q_seq_shards=cp` so that the library's block maps split by query rows; each device takes its
own share of the maps by its index on `context` (what `SplashAttentionKernel.
manual_sharding_spec` gives a shard_map) and the kernel computes the partial tiles' mask from
the positions. So the tiles above the causal diagonal are skipped for the permuted rows too.

`interpret=True` (or the `interpret()` context) runs the same kernel in Pallas' interpreter on any
backend: that is how the CPU tests check its numerics against `attend_dot`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash_lib

from expertax.sharding.rules import current_rules, logical_to_spec

LANES = 128  # the kernel's tiles are multiples of the TPU's 128 lanes
MAX_BLOCK = 512
_INTERPRET: contextvars.ContextVar[bool] = contextvars.ContextVar("splash_interpret", default=False)


@contextlib.contextmanager
def interpret():
    """Run the kernel in Pallas' interpreter wherever it is called (tests on the CPU)."""
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def interpreting() -> bool:
    return _INTERPRET.get()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def block_size(length: int) -> int:
    """Rows per tile for a sequence of `length` (see the module docstring)."""
    padded = _round_up(length, LANES)
    if padded <= MAX_BLOCK:
        return padded
    return next(b for b in (MAX_BLOCK, 256, LANES) if padded % b == 0)


def visited_tiles(length: int) -> tuple[int, int]:
    """(tiles the causal kernel computes, tiles in the [T, S] grid) per head: n (n + 1) / 2 of
    n^2, n = the padded length / block (the diagonal tiles are partial, computed whole)."""
    n = _round_up(length, LANES) // block_size(length)
    return n * (n + 1) // 2, n * n


def _kernel(
    heads: int,
    q_length: int,
    kv_length: int,
    offset: int,
    block: int,
    interpret: bool,
    window: int | None = None,
    q_rows: np.ndarray | None = None,
    q_shards: int = 1,
):
    """The kernel for `heads` query heads, padded query and key lengths, the queries' first key
    position `offset` and an optional sliding `window`; `q_rows`: each query row's key position
    where the rows are permuted (context parallelism), `q_shards`: how many devices split the
    query rows. Its block maps are NumPy work at trace time (0.2 s at H=128, T=4096) that become
    arrays of the trace, so a kernel is built per trace, never cached across traces."""
    shape = (q_length, kv_length)
    one: splash_lib.Mask
    if window is None:
        one = splash_lib.CausalMask(shape, offset=offset)
    else:
        one = splash_lib.LocalMask(shape, window_size=(window - 1, 0), offset=offset)
    if q_rows is not None:  # the mask function reads each row's position from q_sequence
        one.q_sequence = np.asarray(q_rows, np.int32)
    mask = splash_lib.MultiHeadMask([one] * heads)
    sizes = splash_lib.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    return splash_lib.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=q_shards, interpret=interpret
    )


def _pad_length(x, length: int):
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, length - x.shape[1])
    return jnp.pad(x, pad)


def _at_default_precision(fn):
    """`fn` with its forward and backward traced at DEFAULT matmul precision. Mosaic refuses a
    16-bit matmul at HIGHEST ("Bad lhs type"; jax 0.10.2, libtpu 0.0.42.1), which a global
    `jax_default_matmul_precision=highest` asks for; 16-bit products are exact in the kernel's
    float32 accumulators at DEFAULT, so nothing changes by it. The backward kernels are traced
    when the gradient is taken, outside this call: hence a custom VJP that traces both under
    the setting."""

    @jax.custom_vjp
    def call(*args):
        with jax.default_matmul_precision("default"):
            return fn(*args)

    def forward(*args):
        with jax.default_matmul_precision("default"):
            return jax.vjp(fn, *args)

    def backward(vjp, d_out):
        with jax.default_matmul_precision("default"):
            return vjp(d_out)

    call.defvjp(forward, backward)
    return call


def _per_sequence(kernel, q_BTHQ, k_BSGQ, v_BSGO, seg_BT, sinks_H):
    """`kernel` on each sequence of the batch, heads first; `seg_BT`: (queries', keys') segment
    ids or None. [B, T, H, O]."""

    def one(q_THQ, k_SGQ, v_SGO, seg_T):
        ids = None if seg_T is None else splash_lib.SegmentIds(q=seg_T[0], kv=seg_T[1])
        heads_first = (jnp.swapaxes(x, 0, 1) for x in (q_THQ, k_SGQ, v_SGO))
        return jnp.swapaxes(kernel(*heads_first, segment_ids=ids, sinks=sinks_H), 0, 1)

    in_axes = (0, 0, 0, None if seg_BT is None else 0)
    return jax.vmap(one, in_axes=in_axes)(q_BTHQ, k_BSGQ, v_BSGO, seg_BT)


def _attend_local(
    q_BTHQ,
    k_BSGQ,
    v_BSGO,
    segment_ids_BT,
    sink_logits_H,
    *,
    scale: float,
    interpret: bool,
    window: int | None,
):
    """One device's sequences and heads, whole lengths; returns [B, T, H, O]. The queries are
    the last T of the S key positions; `segment_ids_BT` are the keys' [B, S]."""
    t, h, s = q_BTHQ.shape[1], q_BTHQ.shape[2], k_BSGQ.shape[1]
    block = block_size(t)
    padded_q, padded_kv = _round_up(t, block), _round_up(s, block)
    q_BTHQ = (q_BTHQ * jnp.asarray(scale, q_BTHQ.dtype)).astype(q_BTHQ.dtype)
    q = _pad_length(q_BTHQ, padded_q)
    k, v = (_pad_length(x, padded_kv) for x in (k_BSGQ, v_BSGO))
    seg = None
    if segment_ids_BT is not None:
        seg = (
            _pad_length(segment_ids_BT[:, s - t :], padded_q),
            _pad_length(segment_ids_BT, padded_kv),
        )

    def batch(q_BTHQ, k_BSGQ, v_BSGO, seg_BT, sinks_H):
        # Built inside the traced function: its block maps must be arrays of this trace.
        kernel = _kernel(h, padded_q, padded_kv, s - t, block, interpret, window)
        return _per_sequence(kernel, q_BTHQ, k_BSGQ, v_BSGO, seg_BT, sinks_H)

    if jnp.dtype(q.dtype).itemsize == 2:
        batch = _at_default_precision(batch)
    sinks = None if sink_logits_H is None else sink_logits_H.astype(jnp.float32)
    out = batch(q, k, v, seg, sinks)
    return out[:, :t]


def attend_splash(
    q_BTHQ: jax.Array,
    k_BSGQ: jax.Array,
    v_BSGO: jax.Array,
    *,
    scale: float,
    segment_ids_BT: jax.Array | None = None,
    window: int | None = None,
    sink_logits_H: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal splash attention, within a sliding `window` of positions where given; same
    arguments and result ([B, T, H, O]) as `kernel.attend_dot` (the queries are the last T of
    the S >= T key positions: a sequence attending to itself, or one token chunk of it to the
    keys up to its end). `sink_logits_H`: learned attention sinks, one logit per query head,
    which the kernel takes as its own (`sinks`)."""
    if k_BSGQ.shape[1] < q_BTHQ.shape[1]:
        raise ValueError(
            f"attention_impl=splash: {q_BTHQ.shape[1]} query positions after only "
            f"{k_BSGQ.shape[1]} key positions; the queries must be the last of the keys"
        )
    local = functools.partial(_attend_local, scale=scale, interpret=interpret, window=window)
    rules, mesh = current_rules(), jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return local(q_BTHQ, k_BSGQ, v_BSGO, segment_ids_BT, sink_logits_H)
    # Heads split by what divides the kv heads, for queries and keys alike (whole GQA groups).
    b, t, g, qd = k_BSGQ.shape
    spec = logical_to_spec(("batch", None, "act_heads", None), rules, mesh, (b, t, g, qd))
    seg_spec = jax.sharding.PartitionSpec(spec[0] if len(spec) else None)
    # the sinks split as the heads (whole GQA groups per device: H = G x J, contiguous)
    sinks_spec = jax.sharding.PartitionSpec(spec[2] if len(spec) > 2 else None)
    # check_vma=False: the Pallas call declares no varying-axes types (jax 0.10 refuses it with
    # the check on); the gradients under a partly replicating mesh are checked against
    # attend_dot in tests/unit/nn/attention/test_splash.py.
    fn = jax.shard_map(
        local,
        in_specs=(
            spec, spec, spec, None if segment_ids_BT is None else seg_spec,
            None if sink_logits_H is None else sinks_spec,
        ),
        out_specs=spec,
        check_vma=False,
    )  # fmt: skip
    return fn(q_BTHQ, k_BSGQ, v_BSGO, segment_ids_BT, sink_logits_H)


def _shard_of(kernel, index, shards: int):
    """`kernel` with the block maps of query-row shard `index` (traced) of `shards`: what a
    shard_map gives each device with `kernel.manual_sharding_spec` (maps split along their
    query-block axis, `q_sequence` along its rows, partial blocks whole)."""

    def part(info):
        if info is None:
            return None

        def rows(a, axis):
            if a is None:
                return None
            size = a.shape[axis] // shards
            return jax.lax.dynamic_slice_in_dim(jnp.asarray(a), index * size, size, axis)

        return info._replace(
            data_next=rows(info.data_next, 1),
            mask_next=rows(info.mask_next, 1),
            block_mask=rows(info.block_mask, 1),
            q_sequence=rows(info.q_sequence, 0),
        )

    infos, kwargs = kernel.tree_flatten()
    return type(kernel)(*(part(i) for i in infos), **kwargs)


def context_block(chunk: int) -> int:
    """Rows per tile under context parallelism: the largest of 512, 256, 128 dividing a chunk of
    `chunk` rows (config checks refuse a chunk that is not a multiple of 128)."""
    return next(b for b in (MAX_BLOCK, 256, LANES) if chunk % b == 0)


def attend_context(
    q_BTHQ: jax.Array,
    k_BSGQ: jax.Array,
    v_BSGO: jax.Array,
    *,
    scale: float,
    rows: np.ndarray,
    chunk: int,
    shards: int,
    index: jax.Array,
    q_segment_ids_BT: jax.Array | None = None,
    kv_segment_ids_BS: jax.Array | None = None,
    window: int | None = None,
    sink_logits_H: jax.Array | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """One device's query rows [B, T/shards, H, Q] under context parallelism against the whole
    sequence's keys [B, S, G, Q] and values [B, S, G, O] in sequence order; `rows` [S]: the key
    position of every query row of the sequence in the layout the devices hold (shard `index`
    holds rows [index T/shards, (index+1) T/shards)), in contiguous runs of `chunk` rows. Runs
    inside context.py's shard_map; returns [B, T/shards, H, O]."""
    t, h, s = q_BTHQ.shape[1], q_BTHQ.shape[2], k_BSGQ.shape[1]
    if t * shards != s or len(rows) != s:
        raise ValueError(
            f"splash under context parallelism: {t} query rows x {shards} shards against {s} "
            f"keys ({len(rows)} row positions); each device holds 1/{shards} of the sequence"
        )
    block = context_block(chunk)
    interpret = _INTERPRET.get() if interpret is None else interpret
    q_BTHQ = (q_BTHQ * jnp.asarray(scale, q_BTHQ.dtype)).astype(q_BTHQ.dtype)
    seg = None
    if q_segment_ids_BT is not None:
        seg = (q_segment_ids_BT, kv_segment_ids_BS)

    def batch(q_BTHQ, k_BSGQ, v_BSGO, seg_BT, sinks_H, index):
        # built inside the traced function (its block maps are arrays of this trace)
        whole = _kernel(h, s, s, 0, block, interpret, window, q_rows=rows, q_shards=shards)
        kernel = _shard_of(whole, index, shards)
        return _per_sequence(kernel, q_BTHQ, k_BSGQ, v_BSGO, seg_BT, sinks_H)

    if jnp.dtype(q_BTHQ.dtype).itemsize == 2:
        batch = _at_default_precision(batch)
    sinks = None if sink_logits_H is None else sink_logits_H.astype(jnp.float32)
    return batch(q_BTHQ, k_BSGQ, v_BSGO, seg, sinks, index)
