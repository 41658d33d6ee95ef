"""HuggingFace safetensors <-> expertax parameters, for DeepSeek-V3, Mixtral, Qwen3-MoE and
GPT-OSS (its fused experts are read by hf_read.py and written by hf_write.py).

Each HF tensor maps to one slice of one expertax leaf (layers are stacked along a leading axis,
experts along the next). `tensor_map(config)` lists every such mapping, in the HF checkpoint's
order; both directions read it, so they cannot disagree.

Transforms (HF `nn.Linear` weights are [out, in]; ours are [in..., out...]):
- `linear`: ours = W.T reshaped to our (head-split) shape; HF = ours reshaped to [in, out], .T.
- `copy`: norms (Qwen3's per-head `q_norm`/`k_norm` [Q] among them), the embedding, the
  routing bias; `bias`: a projection's bias, HF's [H*Q] as our [H, Q] (GLM-4.5's q/k/v).
- RoPE columns (DeepSeek, `rope_interleave`): HF rotates interleaved pairs (x0, x1), (x2, x3), ...
  and emits them de-interleaved; `nn.rope.apply` rotates half-split pairs (x_i, x_{i+R/2}). Taking
  the even then the odd RoPE columns of wq/wq_b and wkv_a at conversion gives the same q and k
  after RoPE, so attention scores are identical. The inverse permutation restores HF's layout.
Every transform is a transpose, reshape or permutation: the round trip is exact, bit for bit.

DeepSeek-V3's and GLM-4.5's multi-token-prediction modules (`mtp_num_layers` = the hub's
`num_nextn_predict_layers`) are the layers after the main stack, `model.layers.<L + k - 1>.`;
each also stores a copy of the embedding and of the output head, which expertax holds once
(`TensorMap.shared`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from expertax.config import Config
from expertax.models import decoder
from expertax.nn.param import ParamSpec, is_spec


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One HF tensor <-> a slice of one expertax leaf."""

    hf_name: str
    leaf: str  # path in the Decoder tree, e.g. "moe_layers.attn.wq_b"
    index: tuple[int, ...]  # leading indices into the leaf: (layer,) or (layer, expert)
    kind: str  # "linear", "copy" or "flat" (a copy the hub stores flat: [H * Q] <-> our [H, Q])
    n_in: int = 1  # linear: how many leading dims of the slice are the input dims
    rope: tuple[int, int] | None = None  # (offset, size) of interleaved RoPE columns, last axis
    # A copy the hub keeps of a main-model tensor that expertax holds once (an MTP layer's
    # embed_tokens and shared_head.head): from-hf checks it equals the main tensor (the one
    # with the same leaf and index), to-hf writes the main tensor under this name too.
    shared: bool = False


def leaf_specs(c: Config) -> dict[str, ParamSpec]:
    """Every parameter leaf of the model by dotted path."""
    flat = jax.tree_util.tree_flatten_with_path(decoder.spec(c), is_leaf=is_spec)[0]
    return {".".join(k.name for k in path): s for path, s in flat}


def _attention(c: Config, a: str, i: int, p: str, interleave: bool) -> list[TensorMap]:
    """Self-attention of HF layer prefix `p` into slice `i` of the leaves under `a` (e.g.
    "moe_layers.attn", "mtp.block.attn")."""
    if c.attention_type == "gqa":
        norms = [
            TensorMap(p + f"self_attn.{n}.weight", f"{a}.{n}", (i,), "copy")
            for n in ("q_norm", "k_norm")
            if c.attention_qk_norm
        ]
        extra = [  # GPT-OSS's and GLM's biases, GPT-OSS's sinks, where the model has them
            TensorMap(p + f"self_attn.{hf}", f"{a}.{ours}", (i,), "flat")
            for hf, ours, key in (
                ("q_proj.bias", "bq", "attention_qkv_bias"),
                ("k_proj.bias", "bk", "attention_qkv_bias"),
                ("v_proj.bias", "bv", "attention_qkv_bias"),
                ("o_proj.bias", "bo", "attention_out_bias"),
                ("sinks", "sinks", "attention_sinks"),
            )
            if getattr(c, key)
        ]
        return [
            TensorMap(p + "self_attn.q_proj.weight", f"{a}.wq", (i,), "linear"),
            TensorMap(p + "self_attn.k_proj.weight", f"{a}.wk", (i,), "linear"),
            TensorMap(p + "self_attn.v_proj.weight", f"{a}.wv", (i,), "linear"),
            TensorMap(p + "self_attn.o_proj.weight", f"{a}.wo", (i,), "linear", n_in=2),
            *norms,
            *extra,
        ]
    r = c.qk_rope_head_dim
    q_rope = (c.qk_nope_head_dim, r) if interleave else None
    kv_rope = (c.kv_lora_rank, r) if interleave else None
    out = []
    if c.q_lora_rank:
        out += [
            TensorMap(p + "self_attn.q_a_proj.weight", f"{a}.wq_a", (i,), "linear"),
            TensorMap(p + "self_attn.q_a_layernorm.weight", f"{a}.q_norm", (i,), "copy"),
            TensorMap(p + "self_attn.q_b_proj.weight", f"{a}.wq_b", (i,), "linear", rope=q_rope),
        ]
    else:
        out.append(TensorMap(p + "self_attn.q_proj.weight", f"{a}.wq", (i,), "linear", rope=q_rope))
    return out + [
        TensorMap(
            p + "self_attn.kv_a_proj_with_mqa.weight", f"{a}.wkv_a", (i,), "linear", rope=kv_rope
        ),
        TensorMap(p + "self_attn.kv_a_layernorm.weight", f"{a}.kv_norm", (i,), "copy"),
        TensorMap(p + "self_attn.kv_b_proj.weight", f"{a}.wkv_b", (i,), "linear"),
        TensorMap(p + "self_attn.o_proj.weight", f"{a}.wo", (i,), "linear", n_in=2),
    ]


def _mlp(prefix: str, leaf: str, index: tuple[int, ...], names=("gate", "up", "down")):
    g, u, d = (f"{prefix}{n}_proj.weight" for n in names)
    return [
        TensorMap(g, f"{leaf}.wi_0", index, "linear"),
        TensorMap(u, f"{leaf}.wi_1", index, "linear"),
        TensorMap(d, f"{leaf}.wo", index, "linear"),
    ]


def _moe(c: Config, m: str, i: int, p: str) -> list[TensorMap]:
    """The MoE layer of HF layer prefix `p` into slice `i` of the leaves under `m` (e.g.
    "moe_layers.moe", "mtp.block.moe"): Mixtral's names, or DeepSeek-V3's and Qwen3-MoE's
    (`mlp.gate`, `mlp.experts.{j}.{gate,up,down}_proj`; the routing bias and shared experts
    where the model has them)."""
    if c.decoder_block == "gpt_oss":  # the experts: fused tensors (hf_read.py)
        return [
            TensorMap(p + "mlp.router.weight", f"{m}.router.w", (i,), "linear"),
            TensorMap(p + "mlp.router.bias", f"{m}.router.logit_bias", (i,), "copy"),
        ]
    if c.decoder_block == "mixtral":
        out = [TensorMap(p + "block_sparse_moe.gate.weight", f"{m}.router.w", (i,), "linear")]
        for j in range(c.num_experts):
            e = f"{p}block_sparse_moe.experts.{j}."
            out += [
                TensorMap(e + "w1.weight", f"{m}.wi_0", (i, j), "linear"),
                TensorMap(e + "w3.weight", f"{m}.wi_1", (i, j), "linear"),
                TensorMap(e + "w2.weight", f"{m}.wo", (i, j), "linear"),
            ]
        return out
    out = [TensorMap(p + "mlp.gate.weight", f"{m}.router.w", (i,), "linear")]
    if c.routed_bias:
        out.append(
            TensorMap(p + "mlp.gate.e_score_correction_bias", f"{m}.router.bias", (i,), "copy")
        )
    for j in range(c.num_experts):
        out += _mlp(f"{p}mlp.experts.{j}.", m, (i, j))
    if c.shared_experts:
        out += _mlp(f"{p}mlp.shared_experts.", f"{m}.shared", (i,))
    return out


def _block(c: Config, stack: str, i: int, p: str, interleave: bool, dense: bool):
    """A decoder block (attention, its norms, the MLP or MoE) of HF layer prefix `p` into slice
    `i` of the leaves under `stack` ("dense_layers", "moe_layers", "mtp.block")."""
    return [
        *_attention(c, f"{stack}.attn", i, p, interleave),
        TensorMap(p + "input_layernorm.weight", f"{stack}.attn_norm", (i,), "copy"),
        TensorMap(p + "post_attention_layernorm.weight", f"{stack}.ffn_norm", (i,), "copy"),
        *(_mlp(p + "mlp.", f"{stack}.mlp", (i,)) if dense else _moe(c, f"{stack}.moe", i, p)),
    ]


def mtp_layer_prefix(c: Config, k: int) -> str:
    """HF prefix of multi-token-prediction module k (1..D): the layers after the main stack."""
    return f"model.layers.{c.base_num_decoder_layers + k - 1}."


def _mtp(c: Config, interleave: bool) -> list[TensorMap]:
    """DeepSeek-V3's MTP modules as the hub stores them (`DeepseekV3ForCausalLM` of the
    reference code, layer 61): enorm, hnorm, eh_proj [D, 2D], a decoder block, shared_head.norm,
    and copies of the embedding and output head, which expertax shares with the main model."""
    head, kind = ("embed", "copy") if c.logits_via_embedding else ("lm_head", "linear")
    out = []
    for k in range(1, c.mtp_num_layers + 1):
        p, i = mtp_layer_prefix(c, k), k - 1
        out += [
            TensorMap(p + "embed_tokens.weight", "embed", (), "copy", shared=True),
            TensorMap(p + "enorm.weight", "mtp.enorm", (i,), "copy"),
            TensorMap(p + "hnorm.weight", "mtp.hnorm", (i,), "copy"),
            TensorMap(p + "eh_proj.weight", "mtp.eh_proj", (i,), "linear"),
            *_block(c, "mtp.block", i, p, interleave, dense=not c.is_moe),
            TensorMap(p + "shared_head.norm.weight", "mtp.head_norm", (i,), "copy"),
            TensorMap(p + "shared_head.head.weight", head, (), kind, shared=True),
        ]
    return out


def tensor_map(c: Config, *, interleave: bool = True) -> list[TensorMap]:
    """Every HF tensor of the model and where it lives in expertax's tree."""
    out = [TensorMap("model.embed_tokens.weight", "embed", (), "copy")]
    for layer in range(c.base_num_decoder_layers):
        p = f"model.layers.{layer}."
        dense = layer < c.num_dense_layers
        stack = "dense_layers" if dense else "moe_layers"
        i = layer if dense else layer - c.num_dense_layers
        out += _block(c, stack, i, p, interleave, dense)
    out.append(TensorMap("model.norm.weight", "final_norm", (), "copy"))
    if not c.logits_via_embedding:
        out.append(TensorMap("lm_head.weight", "lm_head", (), "linear"))
    return out + _mtp(c, interleave)


# Rows of the source copied per step by `transpose` (see there).
_TRANSPOSE_ROWS = 16


def transpose(w_AB: np.ndarray) -> np.ndarray:
    """`w_AB.T` as a new C-contiguous array, several times faster than `np.ascontiguousarray`.

    numpy copies a transposed view element by element with a stride of a whole row on one side
    (about 0.3 GiB/s for bfloat16 on our 2-core machine); copying 16 source rows at a time writes
    16 consecutive elements of each output row per step, which stays in cache (2 to 3 GiB/s for
    1, 2 and 4-byte types; benchmarks/convert.py). Exact: a copy.
    """
    rows, cols = w_AB.shape
    w_BA = np.empty((cols, rows), w_AB.dtype)
    # Copied as unsigned integers of the same width: numpy's copy of ml_dtypes' bfloat16 and
    # float8 goes through their slower per-element functions.
    bits = f"u{w_AB.dtype.itemsize}"
    src, dst = w_AB.view(bits), w_BA.view(bits)
    for a in range(0, rows, _TRANSPOSE_ROWS):
        dst[:, a : a + _TRANSPOSE_ROWS] = src[a : a + _TRANSPOSE_ROWS].T
    return w_BA


def _rope_perm(size: int) -> np.ndarray:
    """Our RoPE column k holds HF's interleaved column perm[k]: evens, then odds."""
    return np.concatenate([np.arange(0, size, 2), np.arange(1, size, 2)])


def to_ours(t: TensorMap, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """An HF tensor as the slice `shape` of our leaf."""
    if t.kind in ("copy", "flat"):
        return w.reshape(shape)
    x = transpose(w).reshape(shape)
    if t.rope is not None:
        off, r = t.rope
        x[..., off : off + r] = x[..., off + _rope_perm(r)]
    return x


def to_hf(t: TensorMap, x: np.ndarray) -> np.ndarray:
    """Our leaf slice as the HF tensor (inverse of `to_ours`)."""
    if t.kind in ("copy", "flat"):
        return x.reshape(-1) if t.kind == "flat" else x
    if t.rope is not None:
        off, r = t.rope
        y = x.copy()
        y[..., off + _rope_perm(r)] = x[..., off : off + r]
        x = y
    n_in = int(np.prod(x.shape[: t.n_in]))
    return transpose(x.reshape(n_in, -1))


def hf_shape(t: TensorMap, slice_shape: tuple[int, ...]) -> tuple[int, ...]:
    if t.kind in ("copy", "flat"):
        return (int(np.prod(slice_shape)),) if t.kind == "flat" else slice_shape
    n_in = int(np.prod(slice_shape[: t.n_in]))
    return (int(np.prod(slice_shape)) // n_in, n_in)
