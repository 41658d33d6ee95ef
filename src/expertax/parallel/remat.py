"""Names of the activations a user may keep for the backward pass, and remat policies.

Every such tensor is tagged with `checkpoint_name(x, NAME)` exactly where it is produced, using
the constants below (never string literals elsewhere). A policy maps each name to a placement:
`device` (kept in device memory), `offload` (kept in pinned host memory, copied back for the
backward pass) or `remat` (recomputed). Presets are named policies; `remat_policy=custom` reads
one config key per name (`moe_mlpwo=offload query_wa_proj=device ...`).

Where each name is produced (docs/design/remat.md has the table with shapes):
- decoder_layer_input: the input of every decoder layer (models/decoder.py); it is also the scan
  carry, so every policy that rematerializes keeps it.
- query_proj, key_proj, value_proj: per-head queries/keys/values entering the attention kernel
  (GQA: after the projections; MLA: after the RoPE split and concat).
- qkv_proj: reserved for a fused q/k/v projection; neither GQA nor MLA here computes one (their
  projections are separate einsums), so no tensor carries it and saving it saves nothing.
- attention_out: the attention kernel's output; out_proj: after the output projection wo.
- mlpwi_0, mlpwi_1, mlpwo: dense SwiGLU gate, up and output (dense layers and shared experts).
- moe_mlpwi_0, moe_mlpwi_1, moe_mlpwo: routed experts' gate, up and output, in every dispatch
  path: the dense einsum, the separate sparse path (`expert_ffn_sorted`) and the fused routed
  FFN (nn/moe/routed.py, the default, on one device and under the all-to-all and the ring),
  which makes the gate and up `[M, F]` only when one of them is kept and the expert outputs
  `[M, D]` only when moe_mlpwo is kept (its backward reads them then; otherwise it needs none).
  With a paged stash the kept ones are stashed (nn/moe/stash.py).
- query_wa_proj, kv_wa_proj: MLA's low-rank down projections (x @ wq_a, x @ wkv_a).
- mla_q, mla_kv: MLA's per-head queries (before RoPE) and the up-projected keys/values.

Which names each stack of a config can keep is `names_kept` (`unkept` says why not): mlpwo
never (it feeds only the residual add), qkv_proj never, MLA names only under MLA, moe_* only
in MoE layers, mlpwi_* in MoE layers only with shared experts, nothing but the layer input in
a stack the pipeline runs whole or (but the stashed names) in a stashed MoE stack. A custom
placement of a name no stack keeps is refused (parallel/checks.py); docs/design/remat.md has the
table by path.

Two more names belong to the pipeline (models/pipeline.py) and are not user placements:
pipeline_iteration_input (all stages' inputs of one pipeline iteration, the only residual an
iteration keeps under any policy but `none`) and pipeline_stage_weights (a stage's layer group,
indexed from the stacked weights each iteration: never saved, always indexed again).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from jax.ad_checkpoint import checkpoint_name

from expertax import platform

DECODER_LAYER_INPUT = "decoder_layer_input"
QUERY_PROJ = "query_proj"
KEY_PROJ = "key_proj"
VALUE_PROJ = "value_proj"
QKV_PROJ = "qkv_proj"
ATTENTION_OUT = "attention_out"
OUT_PROJ = "out_proj"
MLPWI_0 = "mlpwi_0"
MLPWI_1 = "mlpwi_1"
MLPWO = "mlpwo"
MOE_MLPWI_0 = "moe_mlpwi_0"
MOE_MLPWI_1 = "moe_mlpwi_1"
MOE_MLPWO = "moe_mlpwo"
QUERY_WA_PROJ = "query_wa_proj"
KV_WA_PROJ = "kv_wa_proj"
MLA_Q = "mla_q"
MLA_KV = "mla_kv"
PIPELINE_ITERATION_INPUT = "pipeline_iteration_input"
PIPELINE_STAGE_WEIGHTS = "pipeline_stage_weights"
# Names tagged inside an attention query chunk's own checkpoint (nn/attention/chunks.py): with
# num_attention_token_chunks > 1 the chunk saves them itself, on device; host offload of them
# cannot be honoured there.
QUERY_CHUNK_NAMES = (QUERY_PROJ, ATTENTION_OUT, MLA_Q, QUERY_WA_PROJ)

ALL_NAMES = (
    DECODER_LAYER_INPUT,
    QUERY_PROJ,
    KEY_PROJ,
    VALUE_PROJ,
    QKV_PROJ,
    ATTENTION_OUT,
    OUT_PROJ,
    MLPWI_0,
    MLPWI_1,
    MLPWO,
    MOE_MLPWI_0,
    MOE_MLPWI_1,
    MOE_MLPWO,
    QUERY_WA_PROJ,
    KV_WA_PROJ,
    MLA_Q,
    MLA_KV,
)

DEVICE, OFFLOAD, REMAT = "device", "offload", "remat"
PLACEMENTS = (DEVICE, OFFLOAD, REMAT)

_QKV = (QUERY_PROJ, KEY_PROJ, VALUE_PROJ, QKV_PROJ)
_ATTENTION_DOTS = (*_QKV, OUT_PROJ, QUERY_WA_PROJ, KV_WA_PROJ, MLA_Q, MLA_KV)

# Preset -> names kept on device. The layer input is in every set: it is the scan carry.
PRESETS: dict[str, tuple[str, ...]] = {
    # Recompute the whole layer in the backward pass; keep only its input.
    "full": (DECODER_LAYER_INPUT,),
    # Keep every named tensor except the F-wide MLP/expert hiddens (gate and up), which are
    # recomputed from the saved layer input: the largest activations, the cheapest matmuls.
    "minimal": (DECODER_LAYER_INPUT, *_ATTENTION_DOTS, ATTENTION_OUT, MLPWO, MOE_MLPWO),
    # Keep the attention's q/k/v projections.
    "save_qkv_proj": (DECODER_LAYER_INPUT, *_QKV),
    # Keep every attention projection (q/k/v, out, MLA's low-rank and up projections); the
    # attention kernel and the whole MLP/MoE block are recomputed.
    "save_dot_except_mlp": (DECODER_LAYER_INPUT, *_ATTENTION_DOTS),
    # Keep the attention's output projection.
    "save_out_proj": (DECODER_LAYER_INPUT, OUT_PROJ),
}
# "none": no jax.checkpoint at all; the backward pass keeps every residual autodiff needs.
# "custom": the per-name config keys.
POLICY_NAMES = (*PRESETS, "none", "custom")


def tag(x: jax.Array, name: str) -> jax.Array:
    """Tag an activation with its checkpoint name (one place, so names stay the constants)."""
    return checkpoint_name(x, name)


# The routed experts' grouped-matmul outputs a paged stash can hold (nn/moe/stash.py).
STASHABLE = (MOE_MLPWI_0, MOE_MLPWI_1, MOE_MLPWO)


def stashed_names(c) -> tuple[str, ...]:
    """The STASHABLE names a Config keeps (device or offload): the ones its paged stash holds."""
    place = config_placements(c)
    return tuple(n for n in STASHABLE if place[n] != REMAT)


def stacks(c) -> tuple[str, ...]:
    """The layer stacks of a Config: "dense" and/or "moe"."""
    return tuple(s for s, n in (("dense", c.num_dense_layers), ("moe", c.num_moe_layers)) if n)


def unkept_in_stack(c, stack: str) -> dict[str, str]:
    """Name -> why no layer of `stack` ("dense" or "moe") of Config `c` ever saves it, placed
    alone on `device` or `offload`, for every name its paths do not keep (the per-name tests in
    tests/unit/parallel/test_names_kept.py pin this against the traced residuals)."""
    why = {
        QKV_PROJ: "neither GQA nor MLA computes a fused q/k/v projection (keep query_proj, "
        "key_proj and value_proj instead)",
        MLPWO: "the MLP output feeds only the residual add, so no backward pass reads it "
        "(keep mlpwi_0 and mlpwi_1 to save the MLP's matmuls)",
    }
    if c.attention_type != "mla":
        reason = f"attention_type={c.attention_type} computes no MLA projection"
        why |= dict.fromkeys((QUERY_WA_PROJ, KV_WA_PROJ, MLA_Q, MLA_KV), reason)
    elif not c.q_lora_rank:
        why[QUERY_WA_PROJ] = "q_lora_rank=0: MLA projects the queries without a low-rank down "
        why[QUERY_WA_PROJ] += "projection (set q_lora_rank > 0 to have one)"
    if stack == "moe" and not c.shared_experts:
        why |= dict.fromkeys((MLPWI_0, MLPWI_1), "an MoE layer without shared experts has no MLP")
    if stack == "dense":
        why |= dict.fromkeys(STASHABLE, "a dense layer has no routed experts")
    layers = c.num_moe_layers if stack == "moe" else c.num_dense_layers
    if c.pipelined_stack == stack and c.pipelined_layers == layers and c.remat_policy != "none":
        reason = (
            "a pipelined layer keeps only its iteration's input and recomputes the rest "
            "(models/pipeline.py; set pipeline_parallel_layers below the stack's layers to run "
            "some outside the pipeline)"
        )
        why |= {n: why.get(n, reason) for n in ALL_NAMES if n != DECODER_LAYER_INPUT}
    elif stack == "moe" and c.moe_paged_stash:
        reason = (
            "with moe_paged_stash=true the MoE stack keeps per layer only its input and the "
            f"stashed names ({', '.join(STASHABLE)}; set moe_paged_stash=false)"
        )
        kept = {DECODER_LAYER_INPUT, *STASHABLE}
        why |= {n: why.get(n, reason) for n in ALL_NAMES if n not in kept}
    return why


def names_kept(c) -> dict[str, list[str]]:
    """Stack -> the names its layers save when placed on `device` or `offload`."""
    return {s: [n for n in ALL_NAMES if n not in unkept_in_stack(c, s)] for s in stacks(c)}


def unkept(c) -> dict[str, str]:
    """Name -> why no layer of Config `c` saves it: the names that no stack keeps."""
    per_stack = [unkept_in_stack(c, s) for s in stacks(c)]
    common = set.intersection(*(set(w) for w in per_stack)) if per_stack else set(ALL_NAMES)
    return {n: "; ".join(dict.fromkeys(w[n] for w in per_stack)) for n in ALL_NAMES if n in common}


def placements(remat_policy: str, custom: Mapping[str, str] | None = None) -> dict[str, str]:
    """Name -> device | offload | remat for a preset, or for `custom` from the per-name keys."""
    if remat_policy == "custom":
        custom = dict(custom or {})
        unknown = sorted(set(custom) - set(ALL_NAMES))
        if unknown:
            raise ValueError(f"unknown checkpoint names {unknown}; known: {list(ALL_NAMES)}")
        out = {n: custom.get(n, REMAT) for n in ALL_NAMES}
        for n, p in out.items():
            if p not in PLACEMENTS:
                raise ValueError(f"{n}={p!r}; valid placements: {', '.join(PLACEMENTS)}")
        return out
    if remat_policy == "none":
        return {n: DEVICE for n in ALL_NAMES}
    if remat_policy not in PRESETS:
        raise ValueError(f"remat_policy={remat_policy!r}; valid: {', '.join(POLICY_NAMES)}")
    kept = set(PRESETS[remat_policy])
    return {n: DEVICE if n in kept else REMAT for n in ALL_NAMES}


def config_placements(c) -> dict[str, str]:
    """The placements a Config asks for (its remat_policy and, for custom, its per-name keys)."""
    return placements(c.remat_policy, {n: getattr(c, n) for n in ALL_NAMES})


def checkpoint_policy(place: Mapping[str, str]):
    """The jax.checkpoint policy for a placement map (offload goes to pinned host memory)."""
    saved = [n for n in ALL_NAMES if place[n] == DEVICE]
    offloaded = [n for n in ALL_NAMES if place[n] == OFFLOAD]
    if not offloaded:
        return jax.checkpoint_policies.save_only_these_names(*saved)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved,
        names_which_can_be_offloaded=offloaded,
        offload_src="device",
        offload_dst="pinned_host",
    )


def backend_has_pinned_host(devices=None) -> bool:
    """Whether `devices` (default: the platform being traced for) have pinned host memory."""
    if devices is None and platform.current() in platform.ACCELERATORS:
        return True
    return platform.has_pinned_host(devices)


def check_offload_supported(place: Mapping[str, str], devices=None) -> None:
    """Raise ValueError when some name is to be offloaded and the platform has no pinned host."""
    offloaded = [n for n, p in place.items() if p == OFFLOAD]
    if offloaded and not backend_has_pinned_host(devices):
        on = platform.of_devices(devices) if devices is not None else platform.current()
        raise ValueError(
            f"{', '.join(f'{n}=offload' for n in offloaded)}: the {on} backend "
            "has no pinned_host memory to offload to; use device or remat for these names"
        )


def wrap_layer(fn, c, *, prevent_cse: bool):
    """`fn` under jax.checkpoint with the config's policy; `fn` itself for remat_policy=none."""
    if c.remat_policy == "none":
        return fn
    place = config_placements(c)
    check_offload_supported(place)
    return jax.checkpoint(fn, policy=checkpoint_policy(place), prevent_cse=prevent_cse)
