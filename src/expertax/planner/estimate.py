"""The fit search's analytic estimate of a candidate's peak bytes per device: the state from the
shardings the trainer would build (on an abstract mesh, no devices), the saved residuals of
`residuals.layer_residuals` (traced once per remat preset at one sequence per device, scaled by
the batch per device), and a model of the temporaries (one layer's gathered weights and their
gradients, plus the largest of: the attention scores, the logits of a vocab tile, the MoE dispatch
buffers of a token chunk). It only ranks and prunes; the compiled figure decides.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from expertax import platform
from expertax.config import config_rules
from expertax.config.schema import MESH_AXES, Config
from expertax.models import decoder
from expertax.nn import param
from expertax.nn.attention.kernel import AUTO_BLOCKWISE_MIN_LENGTH
from expertax.parallel import remat
from expertax.planner import plan
from expertax.planner.residuals import layer_residuals
from expertax.sharding.rules import logical_to_spec

GIB = plan.GIB
CHUNKS_KEY = "num_moe_token_chunks"
CPU_EP_ROW_BUFFERS = 9
BLOCKWISE_BLOCK = 512  # key block of the blockwise kernel, for the temporaries model
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
                    for r in layer_residuals(c1, moe=moe, batch_local=1):
                        if r.placement == "device":
                            # the MTP modules' blocks (models/mtp.py) save what a main one does
                            n = r.layers + (c1.mtp_num_layers if moe == c1.is_moe else 0)
                            by_name[r.name] = by_name.get(r.name, 0) + r.bytes * n
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
            copies, row_dt = (CPU_EP_ROW_BUFFERS, 4) if platform.current() == "cpu" else (4, dt)
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
