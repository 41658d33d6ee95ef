"""Model FLOPs (analytic, MoE on routed tokens only), metrics.jsonl and the console line."""

from __future__ import annotations

import math
from pathlib import Path

from expertax import jsonio
from expertax.config.schema import Config


def attention_matmul_params(c: Config) -> int:
    """Matmul weights of one attention block."""
    d, h = c.base_emb_dim, c.base_num_query_heads
    if c.attention_type == "mla":
        qk, v = c.qk_head_dim, c.v_head_dim
        q = d * h * qk if c.q_lora_rank == 0 else d * c.q_lora_rank + c.q_lora_rank * h * qk
        kv = d * (c.kv_lora_rank + c.qk_rope_head_dim)
        kv += c.kv_lora_rank * h * (c.qk_nope_head_dim + v)
        return q + kv + h * v * d
    g, q = c.base_num_kv_heads, c.head_dim
    return d * h * q + 2 * d * g * q + h * q * d


def _flops_per_token_parts(c: Config) -> dict[str, float]:
    """Training FLOPs per token by part: `linears` (the decoder layers' projections and expert
    FFNs, MTP's blocks included: what an fp8 `quantization` takes), `router`, `mtp_proj`,
    `heads` (output heads) and `attention` (the scores and the weighted values)."""
    d = c.base_emb_dim
    attn = attention_matmul_params(c)
    dense_ffn = 3 * d * c.base_mlp_dim
    moe_ffn = 3 * d * c.base_moe_mlp_dim * (c.num_experts_per_tok + c.shared_experts)
    block_linears = attn + (moe_ffn if c.is_moe else dense_ffn)
    linears = (
        c.num_dense_layers * (attn + dense_ffn)
        + c.num_moe_layers * (attn + moe_ffn)
        + c.mtp_num_layers * block_linears
    )
    moe_blocks = c.num_moe_layers + (c.mtp_num_layers if c.is_moe else 0)
    ctx = c.max_target_length / 2
    layers = c.base_num_decoder_layers + c.mtp_num_layers
    scores = 2 * c.base_num_query_heads * (c.qk_head_dim + c.attn_v_head_dim) * ctx * layers
    return {
        "linears": 6 * linears,
        "router": 6 * moe_blocks * d * c.num_experts,
        "mtp_proj": 6 * c.mtp_num_layers * 2 * d * d,
        "heads": 6 * (1 + c.mtp_num_layers) * d * c.vocab_size,
        "attention": 3 * scores,
    }


def train_flops_per_token(c: Config) -> float:
    """6 x matmul parameters used per token + causal attention (3 x forward), per token; with
    multi-token prediction each depth adds its block, its [2D, D] projection and one more
    output head (models/mtp.py)."""
    return float(sum(_flops_per_token_parts(c).values()))


def fp8_flops_fraction(c: Config) -> float:
    """The fraction of the training FLOPs that run as fp8 GEMMs under `quantization` (0 off):
    the decoder layers' linears and expert FFNs; router, MTP projection, heads and the
    attention core stay in dtype."""
    if not c.quantization:
        return 0.0
    parts = _flops_per_token_parts(c)
    return parts["linears"] / sum(parts.values())


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 80.0))


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl (process 0 only)."""

    def __init__(self, run_dir: Path | None):
        self.path = None if run_dir is None else run_dir / "metrics.jsonl"

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(jsonio.dumps(record) + "\n")


def console_line(r: dict) -> str:
    return (
        f"step {r['step']:>5d} | loss {r['loss']:.4f} | ppl {r['perplexity']:.2f} "
        f"| lb {r['lb_loss']:.4f} | "
        + (f"mtp {r['mtp_loss']:.4f} | " if "mtp_loss" in r else "")
        + f"dropped {int(r['dropped_tokens'])} "
        f"| {r['step_time_s']:.3f} s | {r['tokens_per_s_per_device']:.0f} tok/s/dev "
        f"| {r['tflops_per_device']:.4f} TFLOP/s/dev"
    )


def expert_load_summary(load_E) -> dict:
    """max/mean load and the count of experts that received nothing, for one MoE layer's loads
    (assignments per expert; a list or array of E numbers)."""
    load_E = [float(x) for x in load_E]
    mean = sum(load_E) / max(len(load_E), 1)
    return {
        "max_over_mean": max(load_E) / mean if mean > 0 else 0.0,
        "experts_without_tokens": sum(1 for x in load_E if x == 0),
    }


def compact_expert_load(load_LE) -> list[list[int]]:
    """[L_moe][E] whole numbers (the loads are counts of assignments) for metrics.jsonl."""
    return [[int(round(float(x))) for x in load_E] for load_E in load_LE]


def eval_console_line(r: dict) -> str:
    return (
        f"eval  {r['step']:>5d} | loss {r['eval_loss']:.4f} | ppl {r['eval_perplexity']:.2f} "
        f"| {r['eval_tokens']} tokens"
        + (
            f" | mtp loss {r['eval_mtp_loss']:.4f}, acceptance {r['eval_mtp_acceptance']:.3f}"
            if "eval_mtp_loss" in r
            else ""
        )
    )
