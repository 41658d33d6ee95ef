"""`expertax memory --fit`: find a layout, remat and offload under which the train step fits.

The search space, for N devices: splits of N over (expert, fsdp, tensor) with data = 1 that pass
the mesh checks (`sharding.mesh.check_mesh_fit`) and shard something (fsdp divides the model width
D); every `sharding_rules` preset in configs/parallel/; MoE token chunks (`num_moe_token_chunks`,
where the schema has it); loss vocab tiles (`num_vocab_tiling`); blockwise attention; the remat
presets, ordered by the share of layer forward FLOPs they recompute; AdamW moments in bfloat16
(the DeepSeek-V3 recipe); then optimizer and parameter host offload (where the backend has pinned
host memory); and, only with `allow_drops`, a capped all-to-all receive buffer.

Every candidate gets an analytic estimate of its peak bytes per device (`estimate`): the state
from the shardings the trainer would build (computed on an abstract mesh, no devices), the saved
residuals of `tools.memory.layer_residuals` (traced once per remat preset at one sequence per
device, scaled by the batch per device), and a model of the temporaries (one layer's gathered
weights and their gradients, plus the largest of: the attention scores, the logits of a vocab
tile, the MoE dispatch buffers of a token chunk). The estimate is only for ranking and pruning.
Candidates whose estimate meets the budget with the requested headroom are ranked by what they
cost (drops, then offload, then bfloat16 moments, then recompute share, rules, chunks, tiles)
and then by estimate, and compiled AOT best-first (`tools.memory.memory_report`); the search
stops at the first whose compiled peak fits with the headroom. After each compile the remaining
estimates are rescaled by the smallest compiled/estimated ratio seen and pruned again.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from expertax import progress
from expertax.config import ConfigError, build_config, config_rules, configs_dir, load_config
from expertax.config.schema import MESH_AXES, Config
from expertax.models import decoder
from expertax.nn import param
from expertax.nn.attention.kernel import AUTO_BLOCKWISE_MIN_LENGTH
from expertax.parallel import remat
from expertax.sharding.mesh import check_mesh_fit
from expertax.sharding.rules import logical_to_spec
from expertax.tools import memory
from expertax.train.trainer import build_trainer

GIB = memory.GIB
CHUNKS_KEY = "num_moe_token_chunks"
CPU_EP_ROW_BUFFERS = 9
TILES = (1, 4, 16)  # num_vocab_tiling values tried (those dividing max_target_length)
CHUNKS = (1, 2, 4, 8, 16)
DROPS_BUFFER_FACTOR = 2.0  # ragged_buffer_factor tried with allow_drops
BLOCKWISE_BLOCK = 512  # key block of the blockwise kernel, for the temporaries model
# Residual names split over the heads (or MLP hidden) axes of the rules: memory.layer_residuals
# traces without a mesh, so its shapes are not divided by tensor parallelism.
_HEAD_SPLIT = {
    remat.QUERY_PROJ,
    remat.KEY_PROJ,
    remat.VALUE_PROJ,
    remat.ATTENTION_OUT,
    remat.MLA_Q,
    remat.MLA_KV,
    remat.MLPWI_0,
    remat.MLPWI_1,
    remat.MOE_MLPWI_0,
    remat.MOE_MLPWI_1,
}
# Logical axes that shard a weight while it computes (the rest only store it: embed, exp_embed,
# q_lora, kv_lora are all-gathered one layer at a time by the scan).
_COMPUTE_AXES = ("exp", "heads", "kv_heads", "mlp", "exp_mlp", "vocab")


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
# The analytic estimate.


class Estimator:
    """Peak bytes per device of a candidate, from the config alone (no devices, no compile)."""

    def __init__(self, c: Config):
        self.c = c
        self._residuals: dict[tuple, dict[str, int]] = {}
        self._state: dict[tuple, tuple[int, int, int]] = {}
        self._rules: dict[str, dict] = {}

    def rules(self, name: str) -> dict:
        if name not in self._rules:
            self._rules[name] = config_rules(self.c.model_copy(update={"sharding_rules": name}))
        return self._rules[name]

    def residual_bytes(self, preset: str, attention: str, chunks: int) -> dict[str, int]:
        """Saved residual bytes at one sequence per device, by name (all layers)."""
        key = (preset, attention, chunks)
        if key not in self._residuals:
            update: dict[str, Any] = {"remat_policy": preset, "attention_impl": attention}
            update[CHUNKS_KEY] = chunks
            c1 = self.c.model_copy(update=update)
            by_name: dict[str, int] = {}
            for moe, layers in ((False, c1.num_dense_layers), (True, c1.num_moe_layers)):
                if layers:
                    for r in memory.layer_residuals(c1, moe=moe, batch_local=1):
                        if r.placement == "device":
                            by_name[r.name] = by_name.get(r.name, 0) + r.bytes * r.layers
            self._residuals[key] = by_name
        return self._residuals[key]

    def state_bytes(self, shape: dict[str, int], rules_name: str) -> tuple[int, int, int]:
        """(parameter elements, trainable elements, largest layer's elements gathered for
        compute) per device, for a mesh shape and rules preset."""
        key = (tuple(shape.values()), rules_name)
        if key not in self._state:
            c = self.c
            rules = self.rules(rules_name)
            mesh = AbstractMesh(tuple(shape[a] for a in MESH_AXES), MESH_AXES)
            elems = trainable = 0
            for s in jax.tree.leaves(decoder.spec(c), is_leaf=param.is_spec):
                n = _shard_elems(s.shape, s.axes, rules, mesh)
                elems += n
                trainable += n if s.trainable else 0
            layer = 0
            for moe in (False, True):
                if (c.num_moe_layers if moe else c.num_dense_layers) == 0:
                    continue
                block = decoder.block_spec(c, moe=moe)
                compute_rules = {k: (v if k in _COMPUTE_AXES else ()) for k, v in rules.items()}
                n = sum(
                    _shard_elems(s.shape, s.axes, compute_rules, mesh)
                    for s in jax.tree.leaves(block, is_leaf=param.is_spec)
                )
                layer = max(layer, n)
            self._state[key] = (elems, trainable, layer)
        return self._state[key]

    def estimate(self, o: dict[str, Any], shape: dict[str, int]) -> int:
        c = self.c
        size = lambda k: jnp.dtype(o.get(k, getattr(c, k))).itemsize
        elems, trainable, layer_elems = self.state_bytes(shape, o["sharding_rules"])
        params = elems * size("weight_dtype")
        grads = elems * size("grad_dtype")
        opt = trainable * (size("mu_dtype") + size("nu_dtype"))
        rules = self.rules(o["sharding_rules"])
        split = lambda logical, dim: _split(rules, logical, shape, dim)
        batch_shards = split("batch", 1 << 60)
        b = max(1, int(c.per_device_batch_size * math.prod(shape.values())) // batch_shards)
        t, d, dt = c.max_target_length, c.base_emb_dim, jnp.dtype(c.dtype).itemsize
        chunks = o.get(CHUNKS_KEY, 1)
        attention = o.get("attention_impl", c.attention_impl)
        heads = split("act_heads", c.base_num_query_heads)
        res = self.residual_bytes(o["remat_policy"], attention, chunks)
        residuals = b * sum(v // heads if n in _HEAD_SPLIT else v for n, v in res.items())
        # Temporaries: one layer's weights gathered for compute, in weight dtype and in the
        # compute dtype, and its gradient; plus the largest transient of the step.
        gathered = layer_elems * (size("weight_dtype") + dt + size("grad_dtype"))
        h = c.base_num_query_heads // heads
        if _resolve_attention(attention, t) == "dot":
            attn = b * h * t * t * 4 * 2
        else:
            attn = b * h * t * min(t, BLOCKWISE_BLOCK) * 4 * 2
        v = c.vocab_size // split("act_vocab", c.vocab_size)
        logits = b * (t // o["num_vocab_tiling"]) * v * 4 * 3
        moe = 0
        if c.is_moe:
            e, k = shape["expert"], c.num_experts_per_tok
            n_tok = b * t
            if e > 1 and c.sparse_matmul and "expert" in rules.get("batch", ()):
                rows = e * n_tok * min(k, c.num_experts // e)
                factor = o.get("ragged_buffer_factor", c.ragged_buffer_factor)
                if factor > 0:
                    rows = min(rows, math.ceil(factor * n_tok * k))
            else:
                rows = n_tok * k
            f = c.base_moe_mlp_dim // split("exp_mlp", c.base_moe_mlp_dim)
            # XLA:CPU's padded all-to-all stand-in runs the exchange in float32 and keeps about
            # nine [rows, D] buffers at once (their source lines in nn/moe/ep.py, measured by
            # `expertax memory --top` on deepseek3-671b at expert=8); elsewhere about four.
            copies, row_dt = (CPU_EP_ROW_BUFFERS, 4) if jax.default_backend() == "cpu" else (4, dt)
            moe = (rows // chunks) * (copies * d * row_dt + 3 * f * dt)
            if c.float32_weight_sum:
                moe += n_tok * k * d * 4 // chunks
        transient = max(attn, logits, moe)
        device_state = params + grads + opt
        offloaded = 0
        if o.get("optimizer_memory_host_offload"):
            device_state -= opt
            offloaded += opt
        if o.get("parameter_memory_host_offload"):
            device_state -= params
            offloaded += params
        # Offloaded state is copied to device memory for the step: at the update, after the
        # activations are freed (the larger of the two phases).
        return int(device_state + max(residuals + gathered + transient, offloaded))


def _shard_elems(shape, axes, rules, mesh) -> int:
    spec = logical_to_spec(axes, rules, mesh, shape)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    n = math.prod(shape)
    for entry in spec:
        for a in (entry,) if isinstance(entry, str) else (entry or ()):
            n //= sizes[a]
    return n


def _split(rules, logical: str, shape: dict[str, int], dim: int) -> int:
    """How many ways the rules split a dimension `dim` of logical axis `logical`."""
    out = 1
    for a in rules.get(logical, ()):
        if shape.get(a, 1) > 1 and dim % (out * shape[a]) == 0:
            out *= shape[a]
    return out


def _resolve_attention(impl: str, t: int) -> str:
    if impl == "auto":
        return "blockwise" if t >= AUTO_BLOCKWISE_MIN_LENGTH else "dot"
    return impl


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
    c: Config, devices: int, *, allow_drops: bool = False, pinned_host: bool = True
) -> list[Candidate]:
    """Every candidate of the space, with its estimate, cost and recompute share."""
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
    for shape, rules_name in itertools.product(layouts(c, devices), rules_list):
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


def _like_a_miss(x: Candidate, compiled: list[Candidate], target: float) -> bool:
    """Whether the estimate cannot tell `x` from a compiled candidate of the same layout that
    missed the target (within 1%): levers the estimate sees as no change (e.g. vocab tiles when
    the logits are not at the peak) are not compiled again."""
    return any(
        y.peak_device_bytes is not None
        and y.peak_device_bytes > target
        and y.layout == x.layout
        and abs(x.estimate_bytes - y.estimate_bytes) <= 0.01 * y.estimate_bytes
        for y in compiled
    )


def default_compile(c: Config, hbm_gib: float) -> int:
    """The compiled peak bytes per device of `c`: tools.memory.memory_report's figure
    (arguments + outputs - aliased + temporaries, offloaded state taken out once where XLA
    counts pinned host with the device), without its residual trace."""
    trainer = build_trainer(c)
    remat.check_offload_supported(remat.config_placements(c), list(trainer.mesh.devices.flat))
    xla = memory.xla_figures(trainer.compile())
    return memory.device_peak(c, trainer.abstract_state(), xla)[0]


def fit_search(
    c: Config,
    devices: int,
    hbm_gib: float,
    *,
    headroom: float = 10.0,
    allow_drops: bool = False,
    max_compiles: int = 12,
    compile_fn: Callable[[Config, float], int] | None = None,
    log=None,
) -> dict:
    """Search, compile best-first, and return the `fit` report (see the module docstring)."""
    check_inputs(c, devices, hbm_gib, headroom, allow_drops)
    compile_fn = compile_fn or default_compile
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    budget = hbm_gib * GIB
    target = budget * (1 - headroom / 100)
    t0 = time.perf_counter()
    pinned = remat.backend_has_pinned_host()
    pool = candidates(c, devices, allow_drops=allow_drops, pinned_host=pinned)
    log(
        f"[fit] {len(pool)} candidates estimated in {time.perf_counter() - t0:.1f} s; "
        f"target {_b(target)} ({hbm_gib:g} GiB - {headroom:g}% headroom)"
    )
    ratio, ratios = 1.0, []
    compiled: list[Candidate] = []
    tried = set()
    best = None
    bar = progress.bar(min(max_compiles, len(pool)), "memory --fit", unit="candidate")
    log = progress.say_above(bar, log, file=sys.stderr)
    while len(compiled) < max_compiles:
        live = [
            x
            for x in pool
            if id(x) not in tried
            and x.estimate_bytes * ratio <= target
            and not _like_a_miss(x, compiled, target)
        ]
        if not live:
            if compiled:
                break
            live = [x for x in pool if id(x) not in tried]  # nothing passes: try the nearest
            live.sort(key=lambda x: x.estimate_bytes)
            live = live[:1]
            if not live:
                break
        else:
            live.sort(key=lambda x: (x.cost, x.estimate_bytes))
        cand = live[0]
        tried.add(id(cand))
        values = {**c.model_dump(), **cand.overrides}
        try:
            cc = build_config(values)
        except ConfigError as e:
            cand.error = str(e)
            log(f"[fit] skip {cand.describe()}: {e}")
            continue
        n = len(compiled) + 1
        log(
            f"[fit] compile {n}/{max_compiles}: {cand.describe()} "
            f"(estimate {_b(ratio * cand.estimate_bytes)}) ..."
        )
        t1 = time.perf_counter()
        try:
            cand.peak_device_bytes = compile_fn(cc, hbm_gib)
        except Exception as e:  # noqa: BLE001 - a candidate XLA cannot compile is skipped
            cand.error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            log(f"[fit]   failed: {cand.error}")
            continue
        finally:
            cand.seconds = round(time.perf_counter() - t1, 1)
            bar.update(1)
        compiled.append(cand)
        fits = cand.peak_device_bytes <= target
        log(
            f"[fit]   peak {_b(cand.peak_device_bytes)} "
            f"({'fits' if fits else 'over'}) in {cand.seconds} s"
        )
        if cand.estimate_bytes:  # rescale by the most optimistic compiled/estimated ratio yet
            ratios.append(cand.peak_device_bytes / cand.estimate_bytes)
            ratio = min(max(min(ratios), 0.5), 4.0)
        if fits:
            best = cand
            break
    bar.close()
    closest = best or min(compiled, key=lambda x: x.peak_device_bytes or 0, default=None)
    ranked = (
        compiled
        + sorted(
            (x for x in pool if x.peak_device_bytes is None and x.estimate_bytes <= target),
            key=lambda x: (x.cost, x.estimate_bytes),
        )[: max(0, 12 - len(compiled))]
    )
    return {
        "devices": devices,
        "hbm_gib": hbm_gib,
        "headroom_percent": headroom,
        "target_bytes": int(target),
        "searched": len(pool),
        "compiled": len(compiled),
        "seconds": round(time.perf_counter() - t0, 1),
        "candidates": [x.as_json(budget, target) for x in ranked],
        "best": _best_json(best or closest, target),
        "fits": best is not None,
        "train_line": train_line(c, best.overrides) if best else None,
    }


def _best_json(cand: Candidate | None, target: float) -> dict | None:
    if cand is None:
        return None
    peak = cand.peak_device_bytes
    return {
        "overrides": dict(cand.overrides),
        "peak_device_bytes": peak,
        "fits": peak is not None and peak <= target,
        "over_bytes": None if peak is None else max(0, int(peak - target)),
    }


def train_line(c: Config, overrides: dict[str, Any]) -> str:
    """`expertax train model_name=... key=value ...` with every key that differs from the model
    preset (the user's own overrides and the candidate's)."""
    chosen = {**c.model_dump(), **overrides}
    preset = load_config(overrides={"model_name": c.model_name}).model_dump()
    keys = [k for k in Config.model_fields if k != "model_name" and chosen[k] != preset.get(k)]
    keys += [k for k in overrides if k not in keys and k in Config.model_fields]
    items = [f"model_name={c.model_name}"] + [f"{k}={_fmt_value(chosen[k])}" for k in keys]
    return "expertax train " + " ".join(items)


def _fmt_value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def format_fit(r: dict) -> str:
    """The ranked table, then the verdict and the train line."""
    unit, size = ("GiB", GIB) if r["hbm_gib"] >= 4 else ("MiB", 1024**2)
    head = (
        f"{'#':>2} {'layout':<16} {'remat':<19} {'offload':<10} {'chunks':>6} {'tiles':>5} "
        f"{'peak ' + unit:>9} {'headroom':>8} {'recompute':>9} {'est ' + unit:>8}"
    )
    lines = [
        f"expertax memory --fit: {r['devices']} devices x {r['hbm_gib']:g} GiB, headroom "
        f"{r['headroom_percent']:g}% (target {_b(r['target_bytes'])}); "
        f"{r['searched']} candidates estimated, {r['compiled']} compiled in {r['seconds']} s",
        head,
    ]
    for i, x in enumerate(r["candidates"], 1):
        o = x["overrides"]
        peak = x["peak_device_bytes"]
        extra = " ".join(
            f"{k}={o[k]}" for k in ("attention_impl", "mu_dtype", "ragged_buffer_factor") if k in o
        )
        peak_s = "-" if peak is None else f"{peak / size:.2f}"
        room_s = "-" if peak is None else f"{x['headroom_percent']:.1f}%"
        lines.append(
            f"{i:>2} {x['layout']:<16} {x['remat_policy']:<19} {x['offload']:<10} "
            f"{o.get(CHUNKS_KEY, 1):>6} {o['num_vocab_tiling']:>5} "
            f"{peak_s:>9} {room_s:>8} "
            f"{100 * x['recompute_share']:>8.1f}% {x['estimate_bytes'] / size:>8.2f}"
            + (f"  {extra}" if extra else "")
            + (f"  ({x['error']})" if x["error"] else "")
        )
    b = r["best"]
    if r["fits"]:
        lines.append(
            f"FITS: {b['peak_device_bytes'] / size:.2f} {unit} of {r['hbm_gib']:g} GiB per device"
        )
        lines.append(r["train_line"])
    elif b is not None and b["peak_device_bytes"] is not None:
        lines.append(
            f"NO CANDIDATE FITS: the closest compiled, {_describe_overrides(b['overrides'])}, "
            f"peaks at {b['peak_device_bytes'] / size:.2f} {unit}, {b['over_bytes'] / size:.2f} "
            f"{unit} over the {r['target_bytes'] / size:.2f} {unit} target"
        )
    else:
        lines.append("NO CANDIDATE FITS: none compiled")
    return "\n".join(lines)


def _b(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 1024**2:.2f} MiB"


def _describe_overrides(o: dict) -> str:
    return " ".join(f"{k}={_fmt_value(v)}" for k, v in o.items())
