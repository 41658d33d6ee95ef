"""The fit search's analytic estimate of a candidate's bytes per device, as terms the search
calibrates one by one against what it compiles (`calibrate.py`):

- `args`: the parameters and optimizer state the step holds in device memory (its arguments),
  from the shardings the trainer would build, on an abstract mesh (no devices);
- `grads`: the gradients, one buffer per parameter in `grad_dtype`;
- `residual_device` / `residual_host`: the saved activations by placement, from
  `residuals.layer_residuals` (one layer traced per remat choice at one sequence per device,
  scaled by the batch per device and divided by the context axis's split of each sequence), or
  the paged stash's buffers;
- `working`: what one layer's compute holds besides: its weights gathered for compute (and
  their gradients), then the largest of the attention kernel's working set, a vocab tile's
  logits and the MoE layer's dispatch buffers of one token chunk (the sorted rows, the
  exchange's receive buffer and the kernels' outputs: `ROW_BUFFERS` of them per platform, as
  the compiled programs hold them; with several chunks, the local experts' weight gradients the
  chunk loop accumulates); on GPU, a copy of the stacked expert weights in another layout when
  their model dim is split (`expert_relayout_elems`); under context parallelism, T / cp of each
  sequence's tokens, plus the key state attention gathers (`context_gather`);
- `state_host`: optimizer state and parameters offloaded to pinned host memory. The parameters
  are copied to device memory whole for the step (`params_offloaded`); AdamW's update streams
  the optimizer state through the device a layer at a time (train/streamed_update.py), yet the
  TPU program keeps a share of it in device memory through the backward (`opt_offloaded` times
  the calibration's `state` ratio); Muon, and AdamW with the parameters offloaded too, copy it
  in whole for the update (`update`), and the TPU program keeps that copy through the backward
  (`opt_whole`: all of it counted);
- `stack_copies`: on TPU, the program's whole-stack copies of the weights (module `Terms`).

`Terms.peak(ratios)` is their sum with each term scaled by its calibration ratio. The estimate
only ranks and prunes; the compiled program decides.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from expertax import platform
from expertax.config import config_rules
from expertax.config.schema import MESH_AXES, Config
from expertax.models import decoder
from expertax.nn import param
from expertax.nn.attention.blockwise import DEFAULT_BLOCK
from expertax.nn.attention.kernel import AUTO_BLOCKWISE_MIN_LENGTH
from expertax.nn.moe import stash as stash_mod
from expertax.parallel import remat
from expertax.planner import plan
from expertax.planner.residuals import layer_residuals
from expertax.sharding.rules import logical_to_spec
from expertax.train import muon, streamed_update

GIB = plan.GIB
CHUNKS_KEY = "num_moe_token_chunks"
ATT_CHUNKS_KEY = "num_attention_token_chunks"
# [rows, D] buffers one MoE layer's backward holds at once, per platform: the receive buffer,
# the row gathers of the forward replayed and their scatter-adds, the grouped matmuls' input
# gradients and their sum (read off the compiled 671B programs' peaks with `--top`: 5 on TPU
# (megablox), 8 on GPU (tokamax); XLA:CPU's padded all-to-all stand-in keeps about nine, in
# float32).
ROW_BUFFERS = {"tpu": 5, "gpu": 8, "cpu": 9}
# [B, T, D] activations of a layer alive in its backward pass besides the saved ones (its
# input, norms' outputs, the residual stream and their gradients; 8 at the 671B plans' peaks).
LAYER_ACTIVATIONS = 8
# Residual names split over the heads (or MLP hidden) axes of the rules: residuals.layer_residuals
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


class StateElems(NamedTuple):
    """Parameter elements per device (`Estimator.state_bytes`)."""

    params: int
    trainable: int
    layer: int  # the largest layer's, gathered for compute
    second: int  # trainable elements with a second moment (not Muon's matrices)
    muon_leaf: int  # the largest Muon leaf's (its Newton-Schulz working set)
    largest: int  # the largest leaf's


@dataclasses.dataclass(frozen=True)
class Terms:
    """A candidate's estimated bytes per device, by term (module docstring)."""

    args: int
    grads: int
    residual_device: int
    residual_host: int
    working: int
    state_host: int
    # device bytes the update needs beyond the state: the offloaded optimizer state copied in
    # whole where the update does not stream it (train/streamed_update.py `streams`: Muon, or
    # the parameters offloaded too) and Muon's Newton-Schulz working set (its largest leaf's)
    update: int
    # the TPU program's copies of whole stacked weights: each stack converted to the compute
    # dtype before the layer loop (float32 master weights), and one more float32 gradient
    # stack of the largest leaf (the backward loop's carry); 0 on other platforms
    stack_copies: int = 0
    # optimizer state in pinned host memory, of which the TPU program still holds a share in
    # device memory through the backward (`STATE_PRIOR`), and parameters in pinned host memory,
    # copied to device memory whole for the step
    opt_offloaded: int = 0
    params_offloaded: int = 0
    # the offloaded optimizer state copied to the device whole for the update (not streamed):
    # the TPU program holds that copy through the backward's peak (docs/design/fit.md, the e4
    # f32 candidate: 120.49 GiB so, 119.95 with the state on device), so all of it counts
    opt_whole: bool = False

    def state_share(self, ratios: dict[str, float] | None = None) -> float:
        """The share of the offloaded optimizer state the step holds in device memory."""
        r = ratios or {}
        return r.get("whole", 1.0) if self.opt_whole else r.get("state", 0.0)

    def peak(self, ratios: dict[str, float] | None = None) -> int:
        """Device bytes at the peak, each term times its ratio (default 1)."""
        r = ratios or {}
        state = r.get("args", 1.0) * self.args + self.grads + self.params_offloaded
        step = (
            state
            + r.get("residual", 1.0) * self.residual_device
            + r.get("offload", 0.0) * self.residual_host
            + r.get("working", 1.0) * self.working
            + self.stack_copies
            + self.state_share(r) * self.opt_offloaded
        )
        return int(max(step, state + self.update))

    def host(self, ratios: dict[str, float] | None = None) -> int:
        """Pinned host bytes per device."""
        r = ratios or {}
        return int(r.get("host", 1.0) * self.residual_host + self.state_host)

    def as_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class Estimator:
    """Bytes per device of a candidate, from the config alone (no devices, no compile)."""

    def __init__(self, c: Config, on: str | None = None):
        self.c = c
        self.on = on or platform.current()
        self._residuals: dict[tuple, tuple[dict[str, int], dict[str, int]]] = {}
        self._state: dict[tuple, StateElems] = {}
        self._relayout: dict[tuple, int] = {}
        self._rules: dict[str, dict] = {}

    def rules(self, name: str) -> dict:
        if name not in self._rules:
            self._rules[name] = config_rules(self.c.model_copy(update={"sharding_rules": name}))
        return self._rules[name]

    def residual_bytes(self, o: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
        """Saved residual bytes at one sequence per device, by name (all layers): (device,
        host), for the remat keys of candidate `o`."""
        # Token chunks split the MoE layer's named tensors, not their total: one trace serves
        # every chunk count.
        keys = ["remat_policy", "attention_impl", "moe_paged_stash", *remat.ALL_NAMES]
        update = {k: o[k] for k in keys if k in o}
        key = tuple(sorted(update.items()))
        if key not in self._residuals:
            c1 = self.c.model_copy(update=update)
            if c1.remat_policy != "custom":  # the preset places every name itself
                c1 = c1.model_copy(update={n: remat.REMAT for n in remat.ALL_NAMES})
            device: dict[str, int] = {}
            host: dict[str, int] = {}
            for moe, layers in ((False, c1.num_dense_layers), (True, c1.num_moe_layers)):
                if not layers:
                    continue
                if moe and c1.moe_paged_stash:
                    self._stash_input(c1, layers, device, host)
                    continue
                for r in layer_residuals(c1, moe=moe, batch_local=1):
                    # the MTP modules' blocks (models/mtp.py) save what a main one does
                    n = r.layers + (c1.mtp_num_layers if moe == c1.is_moe else 0)
                    out = host if r.placement == "host" else device
                    out[r.name] = out.get(r.name, 0) + r.bytes * n
            self._residuals[key] = (device, host)
        return self._residuals[key]

    def _stash_input(self, c1: Config, layers: int, device: dict, host: dict) -> None:
        """With the paged stash the MoE stack keeps per layer only its input (its placement);
        the stash's buffers are added per candidate (`stash_bytes`: they need the mesh)."""
        x = c1.max_target_length * c1.base_emb_dim * jnp.dtype(c1.dtype).itemsize * layers
        out = host if getattr(c1, remat.DECODER_LAYER_INPUT) == remat.OFFLOAD else device
        out[remat.DECODER_LAYER_INPUT] = out.get(remat.DECODER_LAYER_INPUT, 0) + x

    def stash_bytes(self, o: dict[str, Any], shape: dict[str, int]) -> int:
        """The paged stash's buffers per device (nn/moe/stash.py), for the mesh `shape`."""
        if not o.get("moe_paged_stash"):
            return 0
        c1 = self.c.model_copy(update={k: v for k, v in o.items() if k in Config.model_fields})
        sizes = {a: n for a, n in shape.items() if n > 1}
        tokens = int(c1.per_device_batch_size * math.prod(shape.values())) * c1.max_target_length
        rows = stash_mod.capacity_rows(c1, c1.num_moe_layers, tokens, sizes)
        rows += c1.moe_paged_stash_page_rows
        return rows * stash_mod.row_bytes(c1, sizes, c1.dtype)  # (fp8: gate and up in e4m3)

    def state_bytes(self, shape: dict[str, int], rules_name: str) -> StateElems:
        """Parameter elements per device (`StateElems`), for a mesh shape and rules preset.
        With `opt_type=muon` the matrices Muon
        takes keep one moment, not two (train/muon.py), and its largest leaf sets the
        Newton-Schulz working set (its per-device share: train/muon_layout.py spreads the
        matrices over the devices, padding aside)."""
        key = (tuple(shape.values()), rules_name)
        if key not in self._state:
            c = self.c
            rules = self.rules(rules_name)
            mesh = AbstractMesh(tuple(shape.get(a, 1) for a in MESH_AXES), MESH_AXES)
            elems = trainable = second = muon_leaf = largest = 0
            spec = decoder.spec(c)
            marks = jax.tree.leaves(
                muon.labels(c, spec) if c.opt_type == "muon" else param.trainable_mask(spec)
            )
            for s, mark in zip(jax.tree.leaves(spec, is_leaf=param.is_spec), marks, strict=True):
                n = _shard_elems(s.shape, s.axes, rules, mesh)
                elems += n
                trainable += n if s.trainable else 0
                second += n if s.trainable and mark != "muon" else 0
                muon_leaf = max(muon_leaf, n if mark == "muon" else 0)
                largest = max(largest, n)
            layer = 0
            for moe in (False, True):
                if (c.num_moe_layers if moe else c.num_dense_layers) == 0:
                    continue
                block = decoder.block_spec(c, moe=moe)
                compute_rules = {k: (v if k in _COMPUTE_AXES else ()) for k, v in rules.items()}
                # the MoE layer computes with its experts split as `act_exp` says (the
                # dispatch shard_map's in_specs), whatever splits them in storage (exp-fsdp)
                compute_rules["exp"] = rules.get("act_exp", compute_rules.get("exp", ()))
                n = sum(
                    _shard_elems(s.shape, s.axes, compute_rules, mesh)
                    for s in jax.tree.leaves(block, is_leaf=param.is_spec)
                )
                layer = max(layer, n)
            self._state[key] = StateElems(elems, trainable, layer, second, muon_leaf, largest)
        return self._state[key]

    def expert_relayout_elems(self, shape: dict[str, int], rules_name: str) -> int:
        """Routed-expert weight elements per device that the GPU program copies into another
        layout before the layer loop: all of them when their model dim D is split over a mesh
        axis (the layer's gather over that axis wants D outermost: docs/design/ep.md, "Experts
        stored whole"), none when D is whole (`exp-fsdp`) or on other platforms."""
        key = (tuple(shape.values()), rules_name)
        if key not in self._relayout:
            n = 0
            moe = decoder.spec(self.c).moe_layers
            experts = None if moe is None else moe.moe
            if self.on == "gpu" and experts is not None and self.c.sparse_matmul:
                rules = self.rules(rules_name)
                mesh = AbstractMesh(tuple(shape.get(a, 1) for a in MESH_AXES), MESH_AXES)
                for w in (experts.wi_0, experts.wi_1, experts.wo):
                    spec = logical_to_spec(w.axes, rules, mesh, w.shape)
                    d_dim = w.axes.index("exp_embed")
                    if d_dim < len(spec) and spec[d_dim]:
                        n += _shard_elems(w.shape, w.axes, rules, mesh)
            self._relayout[key] = n
        return self._relayout[key]

    def terms(self, o: dict[str, Any], shape: dict[str, int]) -> Terms:
        c = self.c
        size = lambda k: jnp.dtype(o.get(k, getattr(c, k))).itemsize
        elems, trainable, layer_elems, second, muon_leaf, largest = self.state_bytes(
            shape, o["sharding_rules"]
        )
        # Newton-Schulz of the largest Muon leaf: its Nesterov moment in float32, then the
        # iterate, its Gram products and the result in muon_ns_dtype
        newton_schulz = muon_leaf * (4 + 3 * jnp.dtype(c.muon_ns_dtype).itemsize)
        params = elems * size("weight_dtype")
        opt = trainable * size("mu_dtype") + second * size("nu_dtype")
        rules = self.rules(o["sharding_rules"])
        split = lambda logical, dim: _split(rules, logical, shape, dim)
        b = max(
            1, int(c.per_device_batch_size * math.prod(shape.values())) // split("batch", 1 << 60)
        )
        heads = split("act_heads", c.base_num_query_heads)
        # context parallelism splits each sequence's tokens: a device keeps T / cp of them
        cp = split("length", c.max_target_length)
        device, host = self.residual_bytes(o)
        scale = lambda d: b * sum(v // heads if n in _HEAD_SPLIT else v for n, v in d.items()) // cp
        residual_device = scale(device) + self.stash_bytes(o, shape)
        state_host = opt_off = params_off = 0
        args = params + opt
        if o.get("optimizer_memory_host_offload"):
            args, state_host, opt_off = args - opt, state_host + opt, opt
        if o.get("parameter_memory_host_offload"):
            args, state_host, params_off = args - params, state_host + params, params
        streamed = streamed_update.streams(c.opt_type, params_off > 0)
        copies = 0
        if self.on == "tpu":
            if size("weight_dtype") != jnp.dtype(c.dtype).itemsize:
                copies += elems * jnp.dtype(c.dtype).itemsize
            copies += largest * size("grad_dtype")
        return Terms(
            args=args,
            grads=elems * size("grad_dtype"),
            residual_device=residual_device,
            residual_host=scale(host),
            working=self._working(o, shape, b, heads, cp, layer_elems, size, split, rules)
            + self.expert_relayout_elems(shape, o["sharding_rules"]) * size("weight_dtype"),
            state_host=state_host,
            update=(0 if streamed else opt_off) + newton_schulz,
            stack_copies=copies,
            opt_offloaded=opt_off,
            params_offloaded=params_off,
            opt_whole=opt_off > 0 and not streamed,
        )

    def _working(self, o, shape, b, heads, cp, layer_elems, size, split, rules) -> int:
        """One layer's working set in its backward pass (module docstring): the layer's weights
        gathered in the compute dtype, a few [B, T, D] activations, the attention kernel's
        saved inputs and outputs (alive while the rest of the layer's backward runs), and the
        largest of the MoE backward's buffers, the attention backward's and a vocab tile's
        logits. Under context parallelism (`cp` > 1) a device holds T / cp of each sequence's
        tokens, and attention the gathered key state besides (`context_gather`)."""
        c = self.c
        t, d, dt = c.max_target_length, c.base_emb_dim, jnp.dtype(c.dtype).itemsize
        t_local = t // cp
        gathered = layer_elems * dt
        activations = LAYER_ACTIVATIONS * b * t_local * d * dt
        h = c.base_num_query_heads // heads
        qk, v = c.qk_head_dim, c.attn_v_head_dim
        attention = o.get("attention_impl", c.attention_impl)
        if _resolve_attention(attention, t, self.on) == "dot":
            # the float32 scores, of one query chunk (num_attention_token_chunks)
            saved = b * h * (t_local // o.get(ATT_CHUNKS_KEY, 1)) * t * 4
        else:  # q, k, v, the output, its float32 copy (flash kernels' residuals)
            saved = b * h * t_local * (2 * qk * dt + 2 * v * dt + 4 * v)
        strategy = o.get("context_parallel_strategy", c.context_parallel_strategy)
        saved += context_gather(c, b, h, cp, strategy, _resolve_attention(attention, t, self.on))
        vocab = c.vocab_size // split("act_vocab", c.vocab_size)
        logits = b * (t_local // o["num_vocab_tiling"]) * vocab * 4 * 3
        moe = 0
        if c.is_moe:
            e, k = shape["expert"], c.num_experts_per_tok
            chunks = o.get(CHUNKS_KEY, 1)
            n_tok = b * t_local
            if e > 1 and c.sparse_matmul and "expert" in rules.get("batch", ()):
                rows = e * n_tok * min(k, c.num_experts // e)  # the dropless receive buffer
                factor = o.get("ragged_buffer_factor", c.ragged_buffer_factor)
                if factor > 0:
                    rows = min(rows, math.ceil(factor * n_tok * k))
            else:
                rows = n_tok * k
            f = c.base_moe_mlp_dim // split("exp_mlp", c.base_moe_mlp_dim)
            row_dt = 4 if self.on == "cpu" else dt  # XLA:CPU exchanges bf16 rows in float32
            moe = (rows // chunks) * (ROW_BUFFERS.get(self.on, 5) * d * row_dt + 3 * f * dt)
            if chunks > 1:
                # the chunk loop sums the local experts' weight gradients: three accumulators
                # and the loop's carried copy of one (compiled for tpu:v5p-1024, e2 f256:
                # four float32 [128, 7168, 2048] buffers at the peak, docs/design/fit.md)
                local = c.num_experts // max(1, split("exp", c.num_experts))
                moe += 4 * local * d * f * size("grad_dtype")
            if c.float32_weight_sum:
                moe += n_tok * k * d * 4 // chunks
        return int(gathered + activations + saved + max(moe, saved, logits))

    def estimate(self, o: dict[str, Any], shape: dict[str, int]) -> int:
        """The uncalibrated peak bytes per device."""
        return self.terms(o, shape).peak()


# Copies of the whole sequence's up-projected keys and values that MLA's attention holds under
# context parallelism with splash (or dot): the keys and values, their gradients and the
# backward's copies of the joined [S, H, Qn+O] up-projection (not broken down further). Compiled
# for tpu:v5p-64 (DeepSeek-V3 dims, T/cp = 4,096, benchmarks/context_parallel.py `splash`):
# 12,513 MiB of temporaries at T=32,768, 4.9 x the keys and values' 2,560 MiB.
EXPANDED_COPIES = 5


def context_gather(
    c: Config, b: int, h: int, cp: int, strategy: str = "all_gather", impl: str = "blockwise"
) -> int:
    """Bytes per device attention holds under context parallelism besides its local tokens'
    (nn/attention/context.py), for `b` sequences and `h` query heads per device: the key state
    gathered over the whole sequence (MLA: the normed latent and the rotated RoPE key, kv_lora_rank
    + qk_rope_head_dim values per token; GQA: the keys and values of the device's kv heads), and
    MLA's keys and values up-projected from it one key block at a time (block =
    blockwise.DEFAULT_BLOCK). Under `strategy` ring (MLA, latent_ring.py) no key state is
    gathered: a device holds its own share twice (the state it holds and the one arriving) and
    the float32 gradient buffers that travel with it twice too, T / cp rows each. MLA under
    `impl` dot or splash (the resolved kernel) up-projects the whole gathered sequence instead of
    one block: `EXPANDED_COPIES` of its keys and values. 0 without context parallelism."""
    if cp == 1:
        return 0
    t, dt = c.max_target_length, jnp.dtype(c.dtype).itemsize
    if c.attention_type == "mla":
        width = c.kv_lora_rank + c.qk_rope_head_dim
        up = c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim
        block = b * min(DEFAULT_BLOCK, t) * h * up * dt
        if strategy == "ring":
            return b * (t // cp) * width * (2 * dt + 2 * 4) + block
        if impl in ("dot", "splash"):  # mla.expand: the whole sequence, and its gradients
            return b * t * width * dt + EXPANDED_COPIES * b * t * h * up * dt
        return b * t * width * dt + block
    heads = c.base_num_query_heads // h  # the tensor split of the heads
    kv = max(1, c.base_num_kv_heads // heads)
    return b * t * kv * c.head_dim * 2 * dt


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


def _resolve_attention(impl: str, t: int, on: str = "cpu") -> str:
    """`auto`'s kernel by length (dot below AUTO_BLOCKWISE_MIN_LENGTH, a flash kernel from
    there: blockwise, splash or cuDNN, whose temporaries are linear in T alike)."""
    if impl == "auto":
        return "blockwise" if t >= AUTO_BLOCKWISE_MIN_LENGTH else "dot"
    return impl
