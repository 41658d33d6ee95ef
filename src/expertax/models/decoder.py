"""The decoder: embed -> dense layer stack -> MoE layer stack -> norm -> output head.

Each stack stores its layers stacked along a leading `layers` axis and runs them with `lax.scan`
(or unrolled, `scan_layers=false`), each layer wrapped in `jax.checkpoint` with the configured
policy. The DeepSeek layout has both stacks; Mixtral only the MoE one; Llama only the dense one.

`forward(..., imposed_LBTK=...)` imposes a routing on the MoE layers (one selection [B, T, K] per
layer, scanned with the layer weights; `router.route`) and returns the routers' own choices in the
stats (`MoEStats.chosen_BTK`): the parity tool's probe (tools/parity/routing.py). Without it the
program is unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.fp8 import quant
from expertax.fp8 import stats as fp8_stats
from expertax.models import layer_pattern, pipeline, stashed_stack
from expertax.nn import activation, embed, linear, mlp, norm
from expertax.nn.attention import gqa, mla
from expertax.nn.linear import project
from expertax.nn.moe import layer as moe_layer
from expertax.nn.moe import unstacked
from expertax.nn.moe.router import MoEStats
from expertax.nn.moe.side import Side
from expertax.nn.param import Param, ParamSpec, logical_axes, params_dataclass, projection, stack
from expertax.parallel import remat
from expertax.sharding import constrain

ACT_BTD = ("batch", "length", "act_embed")


@params_dataclass
class Block:
    attn_norm: Param  # [D]
    attn: mla.MLA | gqa.GQA
    ffn_norm: Param  # [D]
    mlp: mlp.MLP | None
    moe: moe_layer.MoE | None


@params_dataclass
class MTPLayer:
    """One DeepSeek-V3 multi-token-prediction module (models/mtp.py); the embedding and the
    output head are the main model's."""

    enorm: Param  # [D] the RMSNorm of the shifted tokens' embeddings
    hnorm: Param  # [D] the RMSNorm of the previous depth's hidden states
    eh_proj: Param  # [2D, D]: [normed embedding, normed hidden] -> D (the hub's column order)
    block: Block  # the model's decoder block (an MoE block when the model has MoE layers)
    head_norm: Param  # [D] before the shared output head (the hub's shared_head.norm)


@params_dataclass
class Decoder:
    embed: Param  # [V, D]
    dense_layers: Block | None  # stacked [L_dense, ...]
    moe_layers: Block | None  # stacked [L_moe, ...]
    final_norm: Param  # [D]
    lm_head: Param  # [D, V]; None when tied to the embedding
    mtp: MTPLayer | None = None  # stacked [mtp_num_layers, ...]; None without MTP


def block_spec(c: Config, *, moe: bool) -> Block:
    d = c.base_emb_dim
    return Block(
        attn_norm=norm.spec(d),
        attn=mla.spec(c) if c.attention_type == "mla" else gqa.spec(c),
        ffn_norm=norm.spec(d),
        mlp=None if moe else mlp.spec(d, c.base_mlp_dim),
        moe=moe_layer.spec(c) if moe else None,
    )


def _layer_axis(c: Config, *, moe: bool) -> str:
    """`stage_layers` (sharded over `pipeline`) for a stack the pipeline runs whole, else
    `layers`. A partly pipelined stack (pipeline_parallel_layers < its size) keeps `layers`: its
    weights are replicated over the pipeline axis and each stage uses its own slice."""
    n = c.num_moe_layers if moe else c.num_dense_layers
    pipelined = c.pipelined_layers if c.pipelined_stack == ("moe" if moe else "dense") else 0
    return "stage_layers" if pipelined and pipelined == n else "layers"


def mtp_spec(c: Config) -> MTPLayer:
    """One multi-token-prediction module: its block is an MoE block when the model has MoE
    layers (DeepSeek-V3's layer 61), else a dense one."""
    d = c.base_emb_dim
    return MTPLayer(
        enorm=norm.spec(d),
        hnorm=norm.spec(d),
        eh_proj=projection((2 * d, d), (None, "embed"), 2 * d),
        block=block_spec(c, moe=c.is_moe),
        head_norm=norm.spec(d),
    )


def spec(c: Config) -> Decoder:
    """The parameter declaration tree of the whole model."""
    d, v = c.base_emb_dim, c.vocab_size
    dense_n, moe_n = c.num_dense_layers, c.num_moe_layers
    dense = stack(block_spec(c, moe=False), dense_n, _layer_axis(c, moe=False)) if dense_n else None
    moe = stack(block_spec(c, moe=True), moe_n, _layer_axis(c, moe=True)) if moe_n else None
    return Decoder(
        embed=ParamSpec((v, d), ("vocab", "embed"), "normal", 1.0),
        dense_layers=dense,
        moe_layers=moe,
        final_norm=norm.spec(d),
        lm_head=None if c.logits_via_embedding else projection((d, v), ("embed", "vocab"), d),
        mtp=stack(mtp_spec(c), c.mtp_num_layers) if c.mtp_num_layers else None,
    )


def block_apply(
    p: Block, x_BTD, c: Config, positions_BT, segment_ids_BT, dtype, side=None, cache=None,
    window: int | None = None, probe=None,
):  # fmt: skip
    """One pre-norm decoder layer, for training, prefill and decoding alike: (x, MoEStats or
    None, the MoE side left, the attention cache).

    `side` (nn/moe/side.py): the MoE layer's paged stash and imposed routing, or None.
    `cache`: the attention layer's (nn/attention/cache.py; decoding), written and read by
    position, or None. `window`: the layer's sliding attention window (None: full attention;
    models/layer_pattern.py). fp8 weights (fp8/quant.py) are dequantized here, and a MoE layer whose
    experts are held apart runs nn/moe/unstacked.py (decoding on one device: only the chosen
    experts' fp8 weights are dequantized). `probe`: the layer's fp8 probe (float32 zeros,
    fp8/stats.py), into which its fp8 GEMMs count, or None; or {"fp8": ..., "qk": ...} with
    QK-clip's probe (float32 zeros [H], nn/attention/qk_clip.py)."""
    experts = p.moe if unstacked.is_unstacked(p.moe) else None
    if experts is not None:
        p = dataclasses.replace(p, moe=None)
    p, x_BTD = quant.dequantize(p, dtype, x_BTD)  # (no fp8 leaves: as it is)
    x_BTD = remat.tag(x_BTD, remat.DECODER_LAYER_INPUT)
    eps = c.normalization_layer_epsilon
    attn = mla if c.attention_type == "mla" else gqa
    h = norm.rms_norm(p.attn_norm, x_BTD, eps)
    kw = {} if window is None else {"window": window}  # (checks: MLA layers never slide)
    # fp8 training GEMMs (`quantization`) in the layer's linears; decoding (a cache) in dtype
    if isinstance(probe, dict):  # with QK-clip's (train/qk_clip.py `merge`)
        if probe.get("qk") is not None:
            kw["qk_probe"] = probe["qk"]
        probe = probe.get("fp8")
    probe = None if probe is None else fp8_stats.Probe.of(probe)
    with linear.fp8(c.quantization if cache is None else "", probe):
        out, cache = attn.apply(p.attn, h, c, positions_BT, segment_ids_BT, dtype, cache, **kw)
        x_BTD = x_BTD + out
        h = norm.rms_norm(p.ffn_norm, x_BTD, eps)
        stats = None
        if experts is not None:
            y, stats = unstacked.apply(experts, h, c, dtype, None if side is None else side.imposed)
        elif p.moe is not None:
            y, stats, side = moe_layer.apply(p.moe, h, c, dtype, side)
        else:
            assert p.mlp is not None  # a block has an MLP or an MoE (decoder.spec)
            y = mlp.apply(p.mlp, h, dtype, activation.of(c))
    return constrain(x_BTD + y, ACT_BTD), stats, side, cache


def run_stack(
    stacked: Block, x_BTD, c: Config, positions_BT, segment_ids_BT, dtype, imposed_LBTK=None,
    probes=None,
):  # fmt: skip
    """Run a layer stack; returns (x, per-layer stats stacked along a leading axis or None).

    The stack `c.pipelined_stack` runs its first `c.pipelined_layers` layers as a pipeline
    (models/pipeline.py), the rest after it. The MoE stack with `moe_paged_stash` runs as
    models/stashed_stack.py (always scanned). `imposed_LBTK` (an MoE stack's routing, one
    selection per layer) is taken by the plain stack only (not pipelined, not stashed), and so
    (one fp8 probe per layer, fp8/stats.py: [L, ...]) by the plain and the pipelined stacks."""
    moe = stacked.moe is not None
    pipelined = c.pipelined_layers if c.pipelined_stack == ("moe" if moe else "dense") else 0
    if imposed_LBTK is not None and (pipelined or c.moe_paged_stash):
        raise ValueError(
            "an imposed routing needs the plain layer stack (ici_pipeline_parallelism=1 for the "
            "MoE layers, moe_paged_stash=false)"
        )
    if not pipelined:
        return _run_layers(
            stacked, x_BTD, c, positions_BT, segment_ids_BT, dtype, imposed_LBTK, probes=probes
        )

    def layer(window):
        def fn(x, p, positions, segment_ids):
            p, probe = p if probes is not None else (p, None)
            return block_apply(p, x, c, positions, segment_ids, dtype, window=window, probe=probe)[
                :2
            ]

        return fn

    # one layer function per kind: the pipeline runs layer l as kind l mod n (its stage visits
    # are whole cycles, checks.check_layer_pattern)
    layers = [layer(w) for w in layer_pattern.windows(c)]
    head = jax.tree.map(lambda a: a[:pipelined], stacked)
    axes = logical_axes(block_spec(c, moe=moe))
    head_probes = None if probes is None else jax.tree.map(lambda a: a[:pipelined], probes)
    x_BTD, stats = pipeline.run(
        head, x_BTD, positions_BT, segment_ids_BT, c, layers, axes, probes=head_probes
    )
    n = jax.tree.leaves(stacked)[0].shape[0]
    if pipelined == n:
        return x_BTD, stats
    rest = jax.tree.map(lambda a: a[pipelined:], stacked)
    rest_probes = None if probes is None else jax.tree.map(lambda a: a[pipelined:], probes)
    x_BTD, more = _run_layers(
        rest, x_BTD, c, positions_BT, segment_ids_BT, dtype, first=pipelined, probes=rest_probes
    )
    if stats is None:
        return x_BTD, None
    return x_BTD, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, more)


def _run_layers(
    stacked: Block,
    x_BTD,
    c: Config,
    positions_BT,
    segment_ids_BT,
    dtype,
    imposed_LBTK=None,
    first: int = 0,
    probes=None,
):
    """`run_stack` without a pipeline: one scan (or unrolled loop) over the layers, each with its
    imposed routing when `imposed_LBTK` is given and its fp8 probe when `probes` are. `first`:
    the index of `stacked`'s first layer in its stack (the layers after a pipeline), which places
    the layers in the kinds' cycle. The probes ride with the weights, so that the paged stash's
    VJP returns their cotangents with the weights' gradients."""
    cycle, n = layer_pattern.windows(c), jax.tree.leaves(stacked)[0].shape[0]
    if n % len(cycle):  # (checks.check_layer_pattern refuses it)
        raise ValueError(f"{n} layers from layer {first}: not whole cycles of {len(cycle)} kinds")
    windows = [layer_pattern.window_of(c, first + j) for j in range(len(cycle))]
    if stacked.moe is not None and c.moe_paged_stash:

        def block(window):
            def fn(layer, x, positions_BT, segment_ids_BT, stash):
                p, probe = layer
                side = Side(stash=stash)
                out = block_apply(
                    p, x, c, positions_BT, segment_ids_BT, dtype, side, window=window, probe=probe
                )
                return out[0], out[1], out[2].stash

            return fn

        blocks = [block(w) for w in windows]
        layers = (stacked, probes)
        return stashed_stack.run(layers, x_BTD, positions_BT, segment_ids_BT, c, blocks)

    def layer_body(window):
        def body(x, layer):
            layer_params, imposed_BTK, probe = layer
            side = None if imposed_BTK is None else Side(imposed=imposed_BTK)
            out = block_apply(
                layer_params, x, c, positions_BT, segment_ids_BT, dtype, side, window=window,
                probe=probe,
            )  # fmt: skip
            return out[:2]

        # One policy for the dense and the MoE stack; jax.checkpoint's CSE prevention is only
        # needed unrolled (scan already keeps the recomputation from being merged with the
        # forward).
        return remat.wrap_layer(body, c, prevent_cse=not c.scan_layers)

    bodies = [layer_body(w) for w in windows]
    if c.scan_layers:
        return layer_pattern.scan(bodies, x_BTD, (stacked, imposed_LBTK, probes))
    all_stats = []
    for i in range(n):
        layer = jax.tree.map(lambda a, i=i: a[i], (stacked, imposed_LBTK, probes))
        x_BTD, stats = bodies[i % len(bodies)](x_BTD, layer)
        all_stats.append(stats)
    stacked_stats = (
        None if all_stats[0] is None else jax.tree.map(lambda *s: jnp.stack(s), *all_stats)
    )
    return x_BTD, stacked_stats


def forward(
    params: Decoder,
    inputs_BT: jax.Array,
    c: Config,
    *,
    positions_BT: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
    imposed_LBTK: jax.Array | None = None,
) -> tuple[jax.Array, MoEStats | None]:
    """Float32 logits [B, T, V] and the MoE layers' stats ([L_moe, ...] leaves, or None).

    `imposed_LBTK` (int32 [L_moe, B, T, K], optional): the experts each MoE layer uses per
    (token, slot) where >= 0 instead of its router's choice; the stats then hold the routers' own
    choices (`chosen_BTK`, [L_moe, B, T, K])."""
    return forward_embedded(
        params,
        embed_tokens(params, inputs_BT, c),
        c,
        positions_BT=positions_BT,
        segment_ids_BT=segment_ids_BT,
        imposed_LBTK=imposed_LBTK,
    )


def forward_embedded(params: Decoder, x_BTD: jax.Array, c: Config, **kwargs):
    """`forward` from already-embedded inputs [B, T, D] (gradients w.r.t. inputs, tests)."""
    x_BTD, stats = hidden_states(params, x_BTD, c, **kwargs)
    return logits(params, x_BTD, c), stats


def embed_tokens(params: Decoder, inputs_BT: jax.Array, c: Config) -> jax.Array:
    """The token embeddings [B, T, D] in `dtype`.

    The table is gathered over its `embed` (model-dim) shards first, as FSDP gathers any weight
    before use: a lookup from a D-sharded table yields rows sharded on D over mesh axes that the
    activations shard on B (e.g. `expert`), a move the SPMD partitioner can only make by
    replicating the whole [B, T, D] activation ("involuntary full rematerialization").
    """
    table_VD = constrain(params.embed, ("vocab", None), replicated=True)
    x_BTD = embed.lookup(table_VD, inputs_BT, jnp.dtype(c.dtype), use_iota=c.use_iota_embed)
    return constrain(x_BTD, ACT_BTD)


def hidden_states(
    params: Decoder,
    x_BTD: jax.Array,
    c: Config,
    *,
    positions_BT: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
    imposed_LBTK: jax.Array | None = None,
    probes: dict | None = None,
) -> tuple[jax.Array, MoEStats | None]:
    """Embedded inputs [B, T, D] -> the final-normed hidden states before the output head (in
    `dtype`), and the MoE layers' stats (`forward` for `imposed_LBTK`). `probes`: fp8 probes
    of the stacks' layers ("dense", "moe": [L, ...] each; fp8/stats.py), or None."""
    dtype = jnp.dtype(c.dtype)
    b, t, _ = x_BTD.shape
    if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x_BTD = constrain(x_BTD.astype(dtype), ACT_BTD)
    stats = None
    probes = probes or {}
    if params.dense_layers is not None:
        x_BTD, _ = run_stack(
            params.dense_layers, x_BTD, c, positions_BT, segment_ids_BT, dtype,
            probes=probes.get("dense"),
        )  # fmt: skip
    if params.moe_layers is not None:
        x_BTD, stats = run_stack(
            params.moe_layers, x_BTD, c, positions_BT, segment_ids_BT, dtype, imposed_LBTK,
            probes.get("moe"),
        )  # fmt: skip
    return norm.rms_norm(params.final_norm, x_BTD, c.normalization_layer_epsilon), stats


def output_head(params: Decoder, c: Config) -> jax.Array:
    """The output projection [D, V] in `dtype`: the tied embedding's transpose or lm_head."""
    head_DV = params.embed.T if params.lm_head is None else params.lm_head
    return head_DV.astype(jnp.dtype(c.dtype))


def logits(params: Decoder, x_BTD: jax.Array, c: Config) -> jax.Array:
    """Float32 logits [B, T, V] of final-normed hidden states."""
    out_BTV = project(x_BTD, output_head(params, c), preferred_element_type=jnp.float32)
    return constrain(out_BTV, ("batch", "length", "act_vocab"))
