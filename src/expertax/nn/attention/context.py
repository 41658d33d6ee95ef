"""Context parallelism: each sequence split along its tokens over the `context` mesh axis.

Outside attention nothing is special: the rules presets map the logical `length` axis to
`context`, so every [B, T, ...] activation between layers is split along T, the MoE layer takes
its tokens with that split into the exchange (`strategy.MoESpecs.seq`) and reduces its balancing
statistics over it, and the losses are sums over the global batch (GSPMD reduces them).

Attention is the one place a query needs other devices' tokens. `attend` runs the kernel in a
`shard_map` manual over `context` only (the other axes stay with GSPMD): the queries stay local,
the layer's compact key state (`kv`: MLA's normed latent and rotated RoPE key, 576 values per
token for DeepSeek-V3; GQA's keys and values) is all-gathered over `context` with its positions
and segment ids, and `expand` turns the gathered state into keys and values on each device
(MLA's up-projection by `wkv_b`). So only the latent crosses devices, never the per-head keys and
values (71x more for DeepSeek-V3). With the `blockwise` kernel MLA does not expand at all: its
`latent` kernel (latent_blockwise.py) up-projects one key block at a time inside the loops, so
no device holds the whole sequence's per-head keys and values either (`dot` holds [T, S] scores
per head anyway, and takes the expanded keys). Every kernel that takes positions serves: `dot`
builds the mask from them, `blockwise` skips by row against the gathered keys in sequence
order, given the queries' offset (a traced value from the device's index).

With `context_parallel_strategy=ring` (MLA with the `blockwise` kernel only) nothing is
gathered: each device's latent travels round the context axis and every device attends to the
share it holds at each step (latent_ring.py), so no device holds more than two shares of the
sequence's key state; `all_gather` (the default) gathers it whole, one collective per layer.

Load balancing (`context_parallel_load_balance`): with contiguous chunks the last device's
queries read the most keys. `balance` reorders each sequence once per batch (inputs, targets,
weights, positions, segment ids and the MTP depths' targets, computed before it) so that device i
holds chunks i and 2cp-1-i of 2cp: every device then does the same causal work. Its gathered keys
are put back into sequence order, and its two query chunks each attend with their own offset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from expertax import platform
from expertax.config.schema import Config
from expertax.nn import linear
from expertax.nn.attention import kernel, latent_ring, splash
from expertax.nn.attention.latent_ring import CONTEXT
from expertax.nn.attention.mask import CAUSAL, MaskSpec, unsupported
from expertax.sharding.rules import current_rules, logical_to_spec


def size() -> int:
    """The context axis's size in the active mesh when the rules split `length` over it (1 when
    no mesh or rules are set)."""
    rules = current_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty or CONTEXT not in tuple(rules.get("length", ())):
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)).get(CONTEXT, 1)


def chunk_order(cp: int) -> list[int]:
    """The 2cp chunks of a sequence in the order the load-balanced layout holds them: device i's
    two chunks, i and 2cp-1-i, one device after the other."""
    return [k for i in range(cp) for k in (i, 2 * cp - 1 - i)]


def balanced_index(length: int, cp: int) -> np.ndarray:
    """Row r of the reordered sequence is row `balanced_index(...)[r]` of the original one."""
    size = length // (2 * cp)
    return np.concatenate([np.arange(k * size, (k + 1) * size) for k in chunk_order(cp)])


def balance(batch: dict, c: Config, mtp_depths: Callable[[dict, int], tuple] | None = None):
    """The batch reordered for the load-balanced layout (module docstring), or as it is when the
    context axis is one device or `context_parallel_load_balance` is off. Positions (from 0 per
    row when the batch has none) move with the tokens, so attention masks by true position;
    `mtp_depths(batch, k)` (models/mtp.py's depth_targets) gives depth k's shifted tokens,
    targets and weights, computed here in sequence order and stored as `batch["mtp_depths"]`."""
    cp = size()
    if cp == 1 or not c.context_parallel_load_balance:
        return batch
    b, t = batch["inputs"].shape
    out = dict(batch)
    if out.get("positions") is None:
        out["positions"] = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if mtp_depths is not None and c.mtp_num_layers:
        out["mtp_depths"] = [mtp_depths(batch, k) for k in range(1, c.mtp_num_layers + 1)]
    return jax.tree.map(lambda a: reorder(a, cp), out)


def reorder(a: jax.Array, cp: int, axis: int = 1, *, inverse: bool = False) -> jax.Array:
    """`a` with the 2cp chunks of its sequence `axis` in `chunk_order` (`inverse`: back in
    sequence order): static slices joined (not a gather, which the partitioner reshards through
    a replicated copy)."""
    size = a.shape[axis] // (2 * cp)
    order = chunk_order(cp)
    if inverse:
        order = [order.index(k) for k in range(2 * cp)]
    parts = [jax.lax.slice_in_dim(a, k * size, (k + 1) * size, axis=axis) for k in order]
    return jnp.concatenate(parts, axis=axis)


def kernel_impl(c: Config, length: int) -> str:
    """The kernel under context parallelism: one that takes the queries' offset at run time
    (`kernel.SCANNED`); `auto` picks `blockwise` for long sequences, `dot` for short ones, and
    `blockwise` for MLA under `context_parallel_strategy=ring` (the ring's kernel; config checks
    refuse the others before this runs)."""
    if c.attention_impl != "auto":
        return c.attention_impl
    if c.context_parallel_strategy == "ring" and c.attention_type == "mla":
        return "blockwise"
    return "blockwise" if length >= kernel.AUTO_BLOCKWISE_MIN_LENGTH else "dot"


def attend(
    q_BTHQ: jax.Array,
    kv: Any,
    expand: Callable[[Any, Any], tuple[jax.Array, jax.Array]],
    weights: Any,
    c: Config,
    *,
    positions_BT: jax.Array,
    segment_ids_BT: jax.Array | None,
    scale: float,
    sink_logits_H: jax.Array | None = None,
    mask_spec: MaskSpec = CAUSAL,
    latent: Callable[..., jax.Array] | None = None,
) -> jax.Array:
    """Attention of the local queries [B, T, H, Q] (global shapes, T split over `context`)
    against the whole sequence's keys: `kv` (a pytree of [B, T, ...] arrays, the layer's compact
    key state, split like the queries) is gathered over `context` and `expand(kv, weights)`
    gives keys [B, S, G, Q] and values [B, S, G, O] from it on each device. [B, T, H, O].
    `latent(q, kv, weights, **kernel arguments)`: where given and the kernel is `blockwise`,
    called on the gathered state instead of expanding it (MLA: latent_blockwise.py)."""
    cp = size()
    t = q_BTHQ.shape[1]
    balanced = c.context_parallel_load_balance
    impl = kernel_impl(c, t)
    pieces = 2 * cp if balanced else cp
    if t % pieces:
        raise ValueError(
            f"context parallelism: the sequence length {t} does not split into {pieces} chunks"
        )
    chunk = t // pieces
    order = chunk_order(cp) if balanced else list(range(cp))

    def gather(a):
        a = jax.lax.all_gather(a, CONTEXT, axis=1, tiled=True)
        return reorder(a, cp, inverse=True) if balanced else a

    fused = latent is not None and impl == "blockwise"
    if fused and sink_logits_H is not None:
        raise ValueError("context parallelism: the latent kernel takes no attention sinks")
    if impl == "splash":
        _check_splash(mask_spec, chunk)
    ring = c.context_parallel_strategy == "ring"
    if ring and not fused:
        raise ValueError(
            f"context_parallel_strategy=ring rotates MLA's latent through its blockwise kernel; "
            f"this layer runs attention_impl={impl} (config checks refuse it before this)"
        )

    def body(q, kv, weights, pos, seg, sinks):
        # the attention core stays out of the fp8 recipe (its up-projection included: the latent
        # kernel's is not quantized either), and a quantized GEMM's probe or weights would be
        # invariant here while their cotangents vary over `context`
        with linear.fp8(""):
            return _body(q, kv, weights, pos, seg, sinks)

    def _body(q, kv, weights, pos, seg, sinks):
        if ring:  # the latent passed round the ring, never gathered (latent_ring.py)
            return latent_ring.attend_latent_ring(
                q, *kv, weights, order=tuple(order), scale=scale,
                positions_BT=pos, segment_ids_BT=seg, mask_spec=mask_spec,
            )  # fmt: skip
        kv = jax.tree.map(gather, kv)
        k_v = None if fused else expand(kv, weights)
        kv_pos, kv_seg = gather(pos), None if seg is None else gather(seg)
        me = jax.lax.axis_index(CONTEXT)
        if impl == "splash":  # all the device's rows in one call, the mask from their positions
            rows = balanced_index(t, cp) if balanced else np.arange(t)
            return splash.attend_context(
                q, *k_v, scale=scale, rows=rows, chunk=chunk, shards=cp, index=me,
                q_segment_ids_BT=seg, kv_segment_ids_BS=kv_seg, window=mask_spec.window,
                sink_logits_H=sinks,
            )  # fmt: skip
        per = 2 if balanced else 1
        outs = []
        for n in range(per):  # the device's query chunks, each at its own offset
            which = jnp.asarray(order, jnp.int32)[me * per + n]
            rows = slice(n * chunk, (n + 1) * chunk)
            kw = dict(
                scale=scale, segment_ids_BT=kv_seg, q_offset=which * chunk,
                mean_q_offset=(t - chunk) / 2, q_positions_BT=pos[:, rows],
                kv_positions_BS=kv_pos, mask_spec=mask_spec,
            )  # fmt: skip
            if k_v is None:
                outs.append(latent(q[:, rows], kv, weights, **kw))
            else:
                outs.append(kernel.attend(q[:, rows], *k_v, impl=impl, sink_logits_H=sinks, **kw))
        return outs[0] if per == 1 else jnp.concatenate(outs, axis=1)

    rules, mesh = current_rules(), jax.sharding.get_abstract_mesh()

    def spec(axes, x):  # every mesh axis manual: the rules' layout (no `pipeline` in a stage)
        return None if x is None else logical_to_spec(axes, rules, mesh, x.shape)

    def kv_spec(a):  # MLA's [B, T, R] latent parts; GQA's [B, T, G, Q] keys and values
        heads = ("act_kv_heads",) if a.ndim > 3 else ()
        return spec(("batch", "length", *heads, None), a)

    q_spec = spec(("batch", "length", "act_heads", None), q_BTHQ)
    fn = jax.shard_map(
        body,
        in_specs=(
            q_spec,
            jax.tree.map(kv_spec, kv),
            jax.tree.map(lambda w: spec((None,) * (w.ndim - 2) + ("act_heads", None), w), weights),
            spec(("batch", "length"), positions_BT),
            spec(("batch", "length"), segment_ids_BT),
            spec(("act_heads",), sink_logits_H),
        ),
        out_specs=q_spec,
        # a Pallas call declares no varying axes (splash.py); its gradients are checked against
        # one-device attention in tests/unit/nn/attention/test_context_splash.py
        check_vma=c.pipeline_stages == 1 and impl != "splash",
    )
    return fn(q_BTHQ, kv, weights, positions_BT, segment_ids_BT, sink_logits_H)


def _check_splash(mask_spec: MaskSpec, chunk: int) -> None:
    """What splash needs under context parallelism (config checks say it first, naming keys)."""
    reason = unsupported(mask_spec, "splash")
    if reason is not None:
        raise ValueError(reason)
    if chunk % splash.LANES:
        raise ValueError(
            f"attention_impl=splash under context parallelism: chunks of {chunk} rows; the "
            f"kernel's tiles need a multiple of {splash.LANES}"
        )
    if platform.current() != "tpu" and not splash.interpreting():
        raise ValueError(
            f"attention_impl=splash needs a TPU; this program is traced for {platform.current()}"
        )
