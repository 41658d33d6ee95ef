"""The fit search's candidate space, for N devices: splits of N over (context, expert, fsdp,
tensor) with data = 1 that pass the layout checks (`preflight.check_layout`) and shard
something (fsdp divides the model width D; context only where a batch shard holds one sequence:
`context_sizes`); every `sharding_rules` preset in configs/parallel/; MoE token chunks
(`num_moe_token_chunks`); attention query chunks (`num_attention_token_chunks`) with the `dot`
kernel, whose [T, S] scores they split; loss vocab tiles (`num_vocab_tiling`); blockwise
attention where the default would hold whole score matrices; the remat presets and the per-name
placement ladders with host offload and the paged stash (`placements.py`); AdamW moments in
bfloat16 (the DeepSeek-V3 recipe); optimizer and parameter host offload where the target's
program honours them; and, only with `allow_drops`, a capped all-to-all receive buffer.

Each candidate carries its estimate's terms (`estimate.Terms`), its working key (what its
working set depends on: `calibrate.py`) and its step-time estimate (`steptime.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from expertax.config import ConfigError, configs_dir
from expertax.config.schema import Config
from expertax.parallel import remat
from expertax.parallel.checks import OFFLOAD_PLATFORMS
from expertax.planner import placements, steptime
from expertax.planner.estimate import (
    ATT_CHUNKS_KEY,
    CHUNKS_KEY,
    Estimator,
    Terms,
    _resolve_attention,
)
from expertax.preflight import check_layout

TILES = (1, 4, 16)  # num_vocab_tiling values tried (those dividing max_target_length)
CHUNKS = (1, 2, 4, 8, 16, 32, 64)
ATT_CHUNKS = (1, 4, 16)  # num_attention_token_chunks values tried (those dividing the length)
# Below this length a `dot` kernel's [T, T] scores are small beside the layer: no query chunks
ATT_CHUNKS_MIN_LENGTH = 2048
DROPS_BUFFER_FACTOR = 2.0  # ragged_buffer_factor tried with allow_drops
# Tokens of a sequence each device keeps at least under context parallelism (`context_sizes`).
MIN_CONTEXT_TOKENS = 1024
PRESETS = ("none", "minimal", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj", "full")


@dataclasses.dataclass
class Candidate:
    """One point of the search: the config overrides it sets, its estimate and what it cost."""

    overrides: dict[str, Any]
    terms: Terms
    key: tuple  # the working key (calibrate.py)
    remat_label: str
    recompute_share: float
    step: steptime.StepTime | None = None
    estimate_bytes: int = 0  # the calibrated peak at the time it was compiled (or last ranked)
    estimate_host_bytes: int = 0
    peak_device_bytes: int | None = None  # the compiled peak (None: not compiled)
    host_bytes: int | None = None  # the compiled pinned host bytes per device
    seconds: float | None = None
    error: str = ""  # a config check refused it, or the compile failed
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # compute figures, refusal

    @property
    def layout(self) -> str:
        o = self.overrides
        rules = "" if o["sharding_rules"] == "default" else f" {o['sharding_rules']}"
        cp = o.get("ici_context_parallelism", 1)
        return (
            f"e{o['ici_expert_parallelism']} f{o['ici_fsdp_parallelism']} "
            f"t{o['ici_tensor_parallelism']}{f' c{cp}' if cp > 1 else ''}"
            f"{' ring' if cp > 1 and o.get('context_parallel_strategy') == 'ring' else ''}{rules}"
        )

    @property
    def offload(self) -> str:
        o = self.overrides
        parts = [
            name
            for name, key in (
                ("opt", "optimizer_memory_host_offload"),
                ("params", "parameter_memory_host_offload"),
            )
            if o.get(key)
        ]
        return "+".join(parts) or "-"

    def describe(self) -> str:
        o = self.overrides
        extra = [
            f"{k}={o[k]}"
            for k in ("attention_impl", "mu_dtype", "nu_dtype", "ragged_buffer_factor")
            if k in o
        ]
        return (
            f"{self.layout} remat={self.remat_label} chunks={o.get(CHUNKS_KEY, 1)} "
            f"attention_chunks={o.get(ATT_CHUNKS_KEY, 1)} "
            f"tiles={o['num_vocab_tiling']} offload={self.offload}"
            + (" " + " ".join(extra) if extra else "")
        )

    def as_json(self, budget_bytes: float, target_bytes: float) -> dict:
        peak = self.peak_device_bytes
        return {
            "overrides": dict(self.overrides),
            "layout": self.layout,
            "remat_policy": self.overrides["remat_policy"],
            "remat": self.remat_label,
            "offload": self.offload,
            "recompute_share": round(self.recompute_share, 4),
            "estimate_bytes": int(self.estimate_bytes),
            "estimate_host_bytes": int(self.estimate_host_bytes),
            "terms": self.terms.as_json(),
            "step": None if self.step is None else self.step.as_json(),
            "peak_device_bytes": None if peak is None else int(peak),
            "host_bytes": self.host_bytes,
            "estimate_error": (
                None if peak is None or not peak else round(self.estimate_bytes / peak - 1, 4)
            ),
            "headroom_percent": None if peak is None else round(100 * (1 - peak / budget_bytes), 2),
            "fits": None if peak is None else bool(peak <= target_bytes),
            "seconds": self.seconds,
            "error": self.error,
            **{
                k: v
                for k, v in self.extra.items()
                if k
                in (
                    "refused",
                    "not_honoured",
                    "flops_vs_plan",
                    "compiled_step_s",
                    "predicted_step_s",
                    "predicted",
                )
            },
        }


# ---------------------------------------------------------------------------------------------
# The candidate space.


def layouts(c: Config, n: int) -> list[dict[str, int]]:
    """Mesh shapes (data = 1) splitting `n` devices over context, expert, fsdp and tensor that
    pass the mesh checks and shard something: expert divides num_experts (1 for a dense model),
    tensor divides the heads, fsdp divides the model width D, context is one of
    `context_sizes`. Keys in MESH_AXES order."""
    out = []
    experts = c.num_experts if c.is_moe else 1
    for cp in context_sizes(c, n):
        for e in _divisors(n // cp):
            for t in _divisors(n // (cp * e)):
                f = n // (cp * e * t)
                if experts % e or c.base_emb_dim % f:
                    continue
                shape = {
                    "pipeline": 1,
                    "data": 1,
                    "fsdp": f,
                    "context": cp,
                    "expert": e,
                    "tensor": t,
                }
                try:
                    check_layout(c, shape)
                except ConfigError:
                    continue
                if cp > 1 and c.per_device_batch_size * n != f * e:
                    continue  # more than one sequence per batch shard: see `context_sizes`
                out.append(shape)
    return out


def ring_context(c: Config, attention_impl: str) -> bool:
    """Whether a context split of `c` passes MLA's latent round a ring (latent_ring.py) rather
    than gathering it: MLA with the blockwise kernel (or `auto`, which picks it for the ring).
    The ring moves about the gather's bytes (each share once per pass, and the float32
    gradients once, where the gather reduce-scatters them) and does the same work, and holds two
    shares of the key state instead of the whole sequence's, so the search takes it wherever it
    runs. Not always the smaller program: at few context devices its per-token buffers can
    outweigh the whole latent (DeepSeek-V3 at 131,072 tokens, cp=4 on tpu:v5p-1024: 6 GiB more,
    docs/design/context.md), which the estimate does not model: `fit` compiles the answer with
    the other strategy too and keeps the smaller."""
    return c.attention_type == "mla" and attention_impl in ("auto", "blockwise")


def context_sizes(c: Config, n: int) -> list[int]:
    """The context axis sizes searched on `n` devices: 1, and powers of two dividing `n` that
    leave each device at least MIN_CONTEXT_TOKENS of a sequence (below that the gathered keys
    and the per-device kernels cost more than the split saves). Powers of two only: they split
    a slice's torus dimensions, and the lengths are powers of two times a block.

    `layouts` keeps a context size > 1 only where each batch shard (data x fsdp x expert) holds
    one sequence: the tokens per device are per_device_batch_size x T x tensor whatever the
    split, so where a shard holds several sequences, splitting the batch further instead keeps
    as many tokens per device without gathering any keys. Context parallelism is then the lever
    for a batch smaller than the devices (per_device_batch_size < 1), and the search tries one
    or two context sizes per layout, not every power of two (DeepSeek-V3 on 512 devices at
    per_device_batch_size=0.5: 186 meshes with every power of two, 51 with this rule)."""
    out, cp = [1], 2
    while n % cp == 0 and c.max_target_length // cp >= MIN_CONTEXT_TOKENS:
        out.append(cp)
        cp *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rules_presets() -> list[str]:
    return sorted(p.stem for p in (configs_dir() / "parallel").glob("*.yml"))


def recompute_share(c: Config, preset: str) -> float:
    """The fraction of the layers' forward FLOPs the backward pass recomputes under `preset`."""
    return steptime.recompute_share(c.model_copy(update={"remat_policy": preset}))


def remat_presets(c: Config) -> list[str]:
    """The remat presets from least to most recompute."""
    names = [p for p in PRESETS if p == "none" or p in remat.PRESETS]
    return sorted(names, key=lambda p: (recompute_share(c, p), p != "none"))


def remat_choices(c: Config, *, offload: bool) -> list[placements.RematChoice]:
    """Presets, then the placement ladders (host offload only where there is pinned host
    memory; the paged stash for a sparse MoE model outside a pipeline)."""
    stash = c.is_moe and c.sparse_matmul and c.pipeline_stages == 1
    return placements.presets(remat_presets(c)) + placements.ladders(
        c, offload=offload, stash=stash
    )


# ---------------------------------------------------------------------------------------------
# The search's inputs.


def check_inputs(
    c: Config, devices: int, hbm_gib: float | None, headroom: float, allow_drops: bool = False
) -> None:
    """ConfigErrors for what the search cannot take, before anything is estimated or compiled."""
    if hbm_gib is None:
        raise ConfigError("--fit needs --hbm GIB, the device memory budget")
    if not hbm_gib > 0:
        raise ConfigError(f"--hbm={hbm_gib:g}: the device memory budget must be positive")
    if not 0 <= headroom < 100:
        raise ConfigError(f"--headroom={headroom:g}: use a percentage in [0, 100)")
    if devices < 1:
        raise ConfigError(f"--devices={devices}: use a positive number of devices")
    if not layouts(c, devices):
        experts = c.num_experts if c.is_moe else 1
        raise ConfigError(
            f"--devices={devices}: no split of {devices} devices over context x expert x fsdp x "
            "tensor "
            f"passes the mesh checks (expert must divide num_experts={experts}, tensor the "
            f"heads base_num_query_heads={c.base_num_query_heads}, fsdp the width "
            f"base_emb_dim={c.base_emb_dim}, and per_device_batch_size="
            f"{c.per_device_batch_size} x {devices} must split over fsdp x expert; context "
            f"sizes tried: {context_sizes(c, devices)})"
        )
    if not allow_drops and not _dropless(c):
        raise ConfigError(
            f"capacity_factor={c.capacity_factor}, ragged_buffer_factor={c.ragged_buffer_factor}:"
            " the config may drop tokens; --fit searches dropless candidates only unless "
            "--allow-drops"
        )


def _dropless(c: Config) -> bool:
    dense_drops = not c.sparse_matmul and c.capacity_factor > 0
    return not dense_drops and c.ragged_buffer_factor <= 0


def candidates(
    c: Config,
    devices: int,
    *,
    allow_drops: bool = False,
    pinned_host: bool = True,
    state_offload: bool = True,
    buildable: Callable[[dict[str, int]], bool] | None = None,
    on: str | None = None,
    chip=None,
) -> list[Candidate]:
    """Every candidate of the space with its estimate's terms and step-time estimate.

    `pinned_host`: the devices have pinned host memory (activation offload is searched);
    `state_offload`: the target's program holds offloaded parameters and optimizer state in it
    (the GPU compiler without a GPU does not: plan.not_honoured); `buildable` (mesh axis sizes
    -> bool) leaves out layouts the target's topology cannot lay out; `on`, `chip`: the platform
    and chip estimated for."""
    est = Estimator(c, on)
    t = c.max_target_length
    tiles = [n for n in TILES if t % n == 0]
    chunks = [n for n in CHUNKS if t % n == 0] if c.is_moe else [1]
    att_chunks = [n for n in ATT_CHUNKS if t % n == 0 and t >= ATT_CHUNKS_MIN_LENGTH] or [1]
    attentions = [c.attention_impl]
    if _resolve_attention(c.attention_impl, t) == "dot":
        attentions.append("blockwise")
    moments: list[dict[str, Any]] = [{}]
    if (c.mu_dtype, c.nu_dtype) != ("bfloat16", "bfloat16"):
        moments.append({"mu_dtype": "bfloat16", "nu_dtype": "bfloat16"})
    offloads: list[dict[str, Any]] = [{}]
    if pinned_host and state_offload:
        offloads += [
            {"optimizer_memory_host_offload": True},
            {"optimizer_memory_host_offload": True, "parameter_memory_host_offload": True},
        ]
    drops: list[dict[str, Any]] = [{}]
    if allow_drops and c.is_moe and c.sparse_matmul:
        drops.append({"ragged_buffer_factor": DROPS_BUFFER_FACTOR})
    choices = remat_choices(c, offload=pinned_host)
    shares = {ch.label: _share(c, ch) for ch in choices}
    att_share = steptime.attention_chunk_share(c)
    rules_list = rules_presets()
    shapes = [x for x in layouts(c, devices) if buildable is None or buildable(x)]
    out = []
    for shape, rules_name in itertools.product(shapes, rules_list):
        if rules_name != "default" and shape["expert"] == 1:
            continue  # the presets differ in how they use `expert`
        for ch, n_chunks, n_att, tile, att, mom, off, drop in itertools.product(
            choices, chunks, att_chunks, tiles, attentions, moments, offloads, drops
        ):
            if n_att > 1 and (
                _resolve_attention(att, t, est.on) != "dot"
                or ch.offloads_any(remat.QUERY_CHUNK_NAMES)
            ):
                # query chunks bound the dot kernel's [T/n, T] scores; a flash kernel's working
                # set is linear in T already, and its compiled peak rises with them (the
                # chunks' inputs and the keys' gradient accumulators: docs/design/attention.md).
                # Offload inside a chunk is refused (checks.check_attention_token_chunks).
                continue
            if shape["context"] > 1 and n_att > 1:
                # the context split already bounds each device's queries to T / context
                continue
            if n_chunks > 1 and est.on in OFFLOAD_PLATFORMS and ch.offloads_any(remat.STASHABLE):
                continue  # does not compile there (parallel.checks.check_moe_chunk_offload)
            o: dict[str, Any] = {
                "ici_data_parallelism": 1,
                "ici_fsdp_parallelism": shape["fsdp"],
                "ici_context_parallelism": shape["context"],
                "ici_expert_parallelism": shape["expert"],
                "ici_tensor_parallelism": shape["tensor"],
                "sharding_rules": rules_name,
                "num_vocab_tiling": tile,
                CHUNKS_KEY: n_chunks,
                ATT_CHUNKS_KEY: n_att,
                **ch.as_dict,
            }
            if att != c.attention_impl:
                o["attention_impl"] = att
            if shape["context"] > 1:  # (set either way: the user's config may say ring)
                ring = ring_context(c, att)
                o["context_parallel_strategy"] = "ring" if ring else "all_gather"
            o.update(mom)
            o.update(off)
            o.update(drop)
            terms = est.terms(o, shape)
            key = (
                tuple(shape.values()),
                rules_name,
                n_chunks,
                tile,
                n_att,
                att,
                bool(o.get("moe_paged_stash")),
            )
            replays = n_att > 1 and o["remat_policy"] != "none"  # chunks.over_queries
            share = shares[ch.label] + (att_share if replays else 0.0)
            out.append(Candidate(o, terms, key, ch.label, share))
    return out


def _share(c: Config, choice: placements.RematChoice) -> float:
    update = choice.as_dict
    if update.get("remat_policy") != "custom":
        update = {**update, **dict.fromkeys(remat.ALL_NAMES, remat.REMAT)}
    return steptime.recompute_share(c.model_copy(update=update))
