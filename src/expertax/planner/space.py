"""The fit search's candidate space, for N devices: splits of N over (expert, fsdp, tensor) with
data = 1 that pass the mesh checks (`sharding.mesh.check_mesh_fit`) and shard something (fsdp
divides the model width D); every `sharding_rules` preset in configs/parallel/; MoE token chunks
(`num_moe_token_chunks`); loss vocab tiles (`num_vocab_tiling`); blockwise attention; the remat
presets, ordered by the share of layer forward FLOPs they recompute; AdamW moments in bfloat16
(the DeepSeek-V3 recipe); then optimizer and parameter host offload (where the backend has pinned
host memory); and, only with `allow_drops`, a capped all-to-all receive buffer.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from expertax.config import ConfigError, configs_dir
from expertax.config.schema import Config
from expertax.parallel import remat
from expertax.planner.estimate import CHUNKS_KEY, Estimator, _resolve_attention
from expertax.sharding.mesh import check_mesh_fit

TILES = (1, 4, 16)  # num_vocab_tiling values tried (those dividing max_target_length)
CHUNKS = (1, 2, 4, 8, 16)
DROPS_BUFFER_FACTOR = 2.0  # ragged_buffer_factor tried with allow_drops


@dataclasses.dataclass
class Candidate:
    """One point of the search: the config overrides it sets and what it is estimated to take."""

    overrides: dict[str, Any]
    estimate_bytes: int
    recompute_share: float
    cost: tuple
    peak_device_bytes: int | None = None  # the compiled peak (None: not compiled)
    seconds: float | None = None
    error: str = ""  # a config check refused it, or the compile failed
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # compute figures, refusal

    @property
    def layout(self) -> str:
        o = self.overrides
        rules = "" if o["sharding_rules"] == "default" else f" {o['sharding_rules']}"
        return (
            f"e{o['ici_expert_parallelism']} f{o['ici_fsdp_parallelism']} "
            f"t{o['ici_tensor_parallelism']}{rules}"
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
            f"{self.layout} remat={o['remat_policy']} chunks={o.get(CHUNKS_KEY, 1)} "
            f"tiles={o['num_vocab_tiling']} offload={self.offload}"
            + (" " + " ".join(extra) if extra else "")
        )

    def as_json(self, budget_bytes: float, target_bytes: float) -> dict:
        peak = self.peak_device_bytes
        return {
            "overrides": dict(self.overrides),
            "layout": self.layout,
            "remat_policy": self.overrides["remat_policy"],
            "offload": self.offload,
            "recompute_share": round(self.recompute_share, 4),
            "estimate_bytes": int(self.estimate_bytes),
            "peak_device_bytes": None if peak is None else int(peak),
            "headroom_percent": None if peak is None else round(100 * (1 - peak / budget_bytes), 2),
            "fits": None if peak is None else bool(peak <= target_bytes),
            "seconds": self.seconds,
            "error": self.error,
        }


# ---------------------------------------------------------------------------------------------
# The candidate space.


def layouts(c: Config, n: int) -> list[dict[str, int]]:
    """Mesh shapes (data = 1) splitting `n` devices over expert, fsdp and tensor that pass the
    mesh checks and shard something: expert divides num_experts (1 for a dense model), tensor
    divides the heads, fsdp divides the model width D."""
    out = []
    experts = c.num_experts if c.is_moe else 1
    for e in _divisors(n):
        for t in _divisors(n // e):
            f = n // (e * t)
            if experts % e or c.base_emb_dim % f:
                continue
            shape = {"pipeline": 1, "data": 1, "fsdp": f, "expert": e, "tensor": t}
            try:
                check_mesh_fit(c, shape)
            except ConfigError:
                continue
            out.append(shape)
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rules_presets() -> list[str]:
    return sorted(p.stem for p in (configs_dir() / "parallel").glob("*.yml"))


def flops_per_token(c: Config, *, moe: bool) -> dict[str, float]:
    """Forward FLOPs of one layer per token, by part (2 per multiply-add; causal attention)."""
    d, h, t = c.base_emb_dim, c.base_num_query_heads, c.max_target_length
    if c.attention_type == "mla":
        qk, v = c.qk_head_dim, c.v_head_dim
        q = d * c.q_lora_rank + c.q_lora_rank * h * qk if c.q_lora_rank else d * h * qk
        qkv = (
            q
            + d * (c.kv_lora_rank + c.qk_rope_head_dim)
            + c.kv_lora_rank * h * (c.qk_nope_head_dim + v)
        )
        out = h * v * d
    else:
        qk = v = c.head_dim
        qkv = d * h * qk + 2 * d * c.base_num_kv_heads * qk
        out = h * v * d
    kernel = (t / 2) * h * (qk + v)
    if moe:
        ffn_in = (c.num_experts_per_tok + c.shared_experts) * 2 * d * c.base_moe_mlp_dim
        ffn_out = ffn_in / 2
        ffn_in += d * c.num_experts  # the router
    else:
        ffn_in, ffn_out = 2 * d * c.base_mlp_dim, d * c.base_mlp_dim
    parts = {"qkv": qkv, "out": out, "kernel": kernel, "ffn_in": ffn_in, "ffn_out": ffn_out}
    return {k: 2.0 * v for k, v in parts.items()}


_RECOMPUTED = {  # remat preset -> the parts of a layer's forward its backward pass recomputes
    "none": (),
    "minimal": ("ffn_in",),
    "save_dot_except_mlp": ("kernel", "ffn_in", "ffn_out"),
    "save_qkv_proj": ("kernel", "out", "ffn_in", "ffn_out"),
    "save_out_proj": ("qkv", "kernel", "ffn_in", "ffn_out"),
    "full": ("qkv", "out", "kernel", "ffn_in", "ffn_out"),
}


def recompute_share(c: Config, preset: str) -> float:
    """The fraction of the layers' forward FLOPs the backward pass recomputes under `preset`."""
    total = recomputed = 0.0
    for moe, layers in ((False, c.num_dense_layers), (True, c.num_moe_layers)):
        if not layers:
            continue
        parts = flops_per_token(c, moe=moe)
        total += layers * sum(parts.values())
        recomputed += layers * sum(parts[p] for p in _RECOMPUTED[preset])
    return recomputed / total if total else 0.0


def remat_presets(c: Config) -> list[str]:
    """The remat presets from least to most recompute."""
    names = [p for p in _RECOMPUTED if p == "none" or p in remat.PRESETS]
    return sorted(names, key=lambda p: (recompute_share(c, p), p != "none"))


# ---------------------------------------------------------------------------------------------
# The search.


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
            f"--devices={devices}: no split of {devices} devices over expert x fsdp x tensor "
            f"passes the mesh checks (expert must divide num_experts={experts}, tensor the "
            f"heads base_num_query_heads={c.base_num_query_heads}, fsdp the width "
            f"base_emb_dim={c.base_emb_dim}, and per_device_batch_size="
            f"{c.per_device_batch_size} x {devices} must split over fsdp x expert)"
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
    buildable: Callable[[dict[str, int]], bool] | None = None,
) -> list[Candidate]:
    """Every candidate of the space, with its estimate, cost and recompute share; `buildable`
    (mesh axis sizes -> bool) leaves out layouts the target's topology cannot lay out."""
    est = Estimator(c)
    t = c.max_target_length
    tiles = [n for n in TILES if t % n == 0]
    chunks = list(CHUNKS) if c.is_moe else [1]
    attentions = [c.attention_impl]
    if _resolve_attention(c.attention_impl, t) == "dot":
        attentions.append("blockwise")
    moments: list[dict[str, Any]] = [{}]
    if (c.mu_dtype, c.nu_dtype) != ("bfloat16", "bfloat16"):
        moments.append({"mu_dtype": "bfloat16", "nu_dtype": "bfloat16"})
    offloads: list[dict[str, Any]] = [{}]
    if pinned_host:
        offloads += [
            {"optimizer_memory_host_offload": True},
            {"optimizer_memory_host_offload": True, "parameter_memory_host_offload": True},
        ]
    drops: list[dict[str, Any]] = [{}]
    if allow_drops and c.is_moe and c.sparse_matmul:
        drops.append({"ragged_buffer_factor": DROPS_BUFFER_FACTOR})
    presets = remat_presets(c)
    shares = {p: recompute_share(c, p) for p in presets}
    rules_list = rules_presets()
    out = []
    shapes = [x for x in layouts(c, devices) if buildable is None or buildable(x)]
    for shape, rules_name in itertools.product(shapes, rules_list):
        if rules_name != "default" and shape["expert"] == 1:
            continue  # the presets differ in how they use `expert`
        for preset, ch, tile, att, mom, off, drop in itertools.product(
            presets, chunks, tiles, attentions, moments, offloads, drops
        ):
            o = {
                "ici_data_parallelism": 1,
                "ici_fsdp_parallelism": shape["fsdp"],
                "ici_expert_parallelism": shape["expert"],
                "ici_tensor_parallelism": shape["tensor"],
                "sharding_rules": rules_name,
                "remat_policy": preset,
                "num_vocab_tiling": tile,
            }
            o[CHUNKS_KEY] = ch
            if att != c.attention_impl:
                o["attention_impl"] = att
            o.update(mom)
            o.update(off)
            o.update(drop)
            cost = (
                len(drop),
                len(off),
                len(mom),
                shares[preset],
                rules_list.index(rules_name) if rules_name != "default" else -1,
                ch,
                tile,
                len(o) - 7,
            )
            out.append(Candidate(o, est.estimate(o, shape), shares[preset], cost))
    return out
