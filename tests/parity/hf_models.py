"""Tiny random HuggingFace models (PyTorch, CPU, eager attention) for the parity tests.

Weights are redrawn at unit scale (HF's std 0.02 leaves attention nearly uniform and the RoPE
almost irrelevant, which would hide layout bugs); the DeepSeek routing bias gets random nonzero
values so that its mapping changes which experts are chosen.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 256
PROMPT_LEN = 288


def _yarn(mscale: float) -> dict:
    return {
        "rope_type": "yarn",
        "rope_theta": 10_000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": mscale,
        "mscale_all_dim": 1.0,
    }


def deepseek_config(*, q_lora_rank: int | None, mscale: float = 0.707) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=512,
        rope_parameters=_yarn(mscale),
        attn_implementation="eager",
        num_mtp_layers=0,
    )


def mixtral_config() -> MixtralConfig:
    return MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        attn_implementation="eager",
    )


def qwen3_config(*, norm_topk_prob: bool = True, yarn: bool = False) -> Qwen3MoeConfig:
    """Dims that line up nowhere: head_dim 24 (not hidden / heads = 16), 2F = 80 (not 64),
    top-3 of 6 experts, 2 kv heads for 4 query heads."""
    rope = {"rope_type": "default", "rope_theta": 10_000.0}
    if yarn:
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        }
    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=norm_topk_prob,
        max_position_embeddings=512,
        rope_parameters=rope,
        attn_implementation="eager",
    )


def gpt_oss_config(*, hidden: int = 64, layers: int = 2, intermediate: int = 40) -> GptOssConfig:
    """Dims that line up nowhere: head_dim 24 (not hidden / heads = 16), 2F = 80 (not 64), top-3
    of 6 experts; a window of 5 (the prompt is longer), alternating with full layers; YaRN
    without truncation; a clamp of 1.5 that random activations reach. `hidden` = 80 gives
    2F = D, the shape where the fused layouts of GPT-OSS and Mixtral coincide."""
    return GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_local_experts=6,
        num_experts_per_tok=3,
        sliding_window=5,
        swiglu_limit=1.5,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },  # fmt: skip
        attn_implementation="eager",
    )


def glm_config(*, qk_norm: bool = True) -> Glm4MoeConfig:
    """GLM-4.5 with dims that line up nowhere: head_dim 24 (not 64 / 4), 12 of them rotated
    (partial_rotary_factor 0.5), 2F = 80 (not 64); q/k/v biases, 1 dense layer, top-3 of 8
    experts in 4 groups keeping 2, a shared expert; no MTP layer (transformers has none)."""
    return Glm4MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=40,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        attention_bias=True,
        use_qk_norm=qk_norm,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.5,
        },
        attn_implementation="eager",
        num_mtp_layers=0,
    )


def deepseek_v2_config(*, topk_method: str = "greedy") -> DeepseekV2Config:
    """DeepSeek-V2(-Lite): MLA without q LoRA, softmax routing without bias or renormalization,
    two shared experts, 1 dense layer; `group_limited_greedy`: groups scored by their best."""
    return DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        n_shared_experts=2,
        n_routed_experts=8,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        topk_method=topk_method,
        n_group=4 if topk_method == "group_limited_greedy" else None,
        topk_group=2 if topk_method == "group_limited_greedy" else None,
        norm_topk_prob=False,
        max_position_embeddings=512,
        rope_parameters=_yarn(0.707),
        attn_implementation="eager",
    )


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith("self_attn.sinks"):  # large enough to take weight from the keys
            p.copy_(4.0 + torch.randn(p.shape, generator=g))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind.startswith("gpt_oss"):  # "gpt_oss", "gpt_oss-2f-is-d", or "gpt_oss-mxfp4" (F = 64)
        config = gpt_oss_config(
            hidden=80 if kind.endswith("2f-is-d") else 64,
            intermediate=64 if kind.endswith("mxfp4") else 40,
        )
        return randomize(GptOssForCausalLM(config), seed)
    if kind.startswith("qwen3"):  # "qwen3", or "qwen3-yarn": YaRN and unnormalized top-k
        yarn = kind == "qwen3-yarn"
        config = qwen3_config(norm_topk_prob=not yarn, yarn=yarn)
        return randomize(Qwen3MoeForCausalLM(config), seed)
    if kind.startswith("glm"):  # "glm", or "glm-plain": without the q/k norm
        return randomize(Glm4MoeForCausalLM(glm_config(qk_norm=kind == "glm")), seed)
    if kind.startswith("deepseek-v2"):  # "deepseek-v2", or "deepseek-v2-groups"
        method = "group_limited_greedy" if kind == "deepseek-v2-groups" else "greedy"
        return randomize(DeepseekV2ForCausalLM(deepseek_v2_config(topk_method=method)), seed)
    if kind.startswith("mixtral"):
        config = mixtral_config()
        config.tie_word_embeddings = kind == "mixtral-tied"
        return randomize(MixtralForCausalLM(config), seed)
    q_lora = 24 if kind == "deepseek-qlora" else None
    return randomize(DeepseekV3ForCausalLM(deepseek_config(q_lora_rank=q_lora)), seed)


def save(model: torch.nn.Module, path: Path, *, hub_rope_style: bool = False, **kw) -> Path:
    """save_pretrained; `hub_rope_style` rewrites rope_parameters as the hub's rope_scaling."""
    model.save_pretrained(path, **kw)
    if hub_rope_style:
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        rope = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = rope.pop("rope_theta")
        rope["type"] = rope.pop("rope_type")
        cfg["rope_scaling"] = rope
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return path


def prompt(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logits(model: torch.nn.Module, tokens: torch.Tensor):
    return model(tokens).logits.float().numpy()


def save_mxfp4(model: torch.nn.Module, path: Path, seed: int = 0) -> Path:
    """A GPT-OSS checkpoint as the hub stores it: the experts' weights in MXFP4 (random codes,
    scales 2^-6 .. 2^-3: weights of about unit scale / sqrt(fan-in)), the rest as saved. Blocks
    [E, out, in / 32, 16] and scales [E, out, in / 32], as OCP MX and transformers' reader
    define them; the model's own expert weights are discarded."""
    from safetensors.numpy import load_file, save_file

    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    rng = np.random.default_rng(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, n_in, n_out = tensors.pop(name).shape  # transformers: [E, in, out]
        tensors[name + "_blocks"] = rng.integers(0, 256, (e, n_out, n_in // 32, 16), np.uint8)
        tensors[name + "_scales"] = rng.integers(121, 125, (e, n_out, n_in // 32), np.uint8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head",
        ],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def load_mxfp4(path: Path) -> torch.nn.Module:
    """transformers' own reading of an MXFP4 checkpoint, dequantized (the oracle)."""
    from transformers import Mxfp4Config

    return GptOssForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), attn_implementation="eager"
    ).eval()
