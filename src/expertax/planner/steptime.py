"""The fit search's step-time estimate of a candidate, to rank the plans that fit: the model's
FLOPs plus what its remat choice recomputes, at an assumed share of the chip's peak, and what its
host placements move over the host link, overlapped with compute where the schedule allows.

- compute: (model FLOPs + recompute FLOPs) / (peak x `ASSUMED_MFU`); the recompute is the
  forward FLOPs of the layer parts the backward pass replays (`placements.recomputed_parts`);
- activations offloaded: written to host in the forward pass and read back in the backward,
  one layer at a time while other layers compute: they overlap compute and cost only what a
  layer's transfer takes beyond its compute (`max`);
- optimizer state and parameters offloaded: moved in (and out) around the update, which waits
  for them: not overlapped;
- the link: the chip's to host memory, one direction at its nominal rate (targets.HOSTS; the
  CPU proxy has none: transfers cost 0 there);
- collectives (a TPU or GPU target): what each mesh axis of the layout moves, timed on the
  links that axis spans in the target's mesh (planner/comm.py), counted exposed;
- the experts' weights under token chunks (`num_moe_token_chunks` > 1, a TPU or GPU target):
  every chunk's grouped matmuls read the local experts' weights again and add their gradients
  into a float32 accumulator; what that HBM traffic takes beyond the routed matmuls' compute
  is counted (`expert_weight_traffic`: the compiled program's prediction sees the same work
  per operation);
- among equal seconds, by `exchange_bytes`: what the tensor axis's activation all-reduces and the
  context axis's key/value gathers move per device and step (bytes, no link rate: a tie-break
  between splits that compute the same, e.g. a long sequence's heads over `tensor` against its
  tokens over `context`).

An estimate for ranking, never a measured time; the report says so.
"""

from __future__ import annotations

import dataclasses
import math

from expertax.config.schema import Config
from expertax.models import decoder
from expertax.parallel import remat
from expertax.planner import placements
from expertax.planner.estimate import CHUNKS_KEY, Terms
from expertax.train import muon
from expertax.train.metrics import attention_matmul_params, train_flops_per_token

ASSUMED_MFU = 0.5  # the share of the chip's peak the step's matmuls are assumed to reach
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class StepTime:
    model_flops: float  # per device
    recompute_flops: float
    compute_s: float
    activation_transfer_s: float  # overlapped with compute
    state_transfer_s: float  # not overlapped
    link: str
    exchange_bytes: float = 0.0  # tensor all-reduces + context gathers per device (tie-break)
    comm_s: float = 0.0  # the layout's collectives on the target's links, counted exposed
    memory_s: float = 0.0  # the expert weights' HBM traffic beyond the routed matmuls' compute
    optimizer_flops: float = 0.0  # per device: Muon's Newton-Schulz (in compute_s)

    @property
    def seconds(self) -> float:
        overlapped = max(self.compute_s, self.activation_transfer_s)
        return overlapped + self.state_transfer_s + self.comm_s + self.memory_s

    @property
    def recompute_share(self) -> float:
        return self.recompute_flops / self.model_flops if self.model_flops else 0.0

    def as_json(self) -> dict:
        return {**dataclasses.asdict(self), "seconds": self.seconds}


def layer_forward_flops(c: Config, *, moe: bool, t: int | None = None) -> dict[str, float]:
    """Forward FLOPs of one layer per token, by part (2 per multiply-add; causal attention)."""
    d, h = c.base_emb_dim, c.base_num_query_heads
    t = c.max_target_length if t is None else t
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


def exchange_bytes(c: Config, tensor: int, context: int) -> float:
    """Bytes one device moves per step in the tensor axis's activation all-reduces and the
    context axis's gathers (16-bit activations; ring collectives move (n - 1) / n of the whole).

    - tensor t: per layer two all-reduces of the [tokens, D] activations forward (attention's
      and the MLP's outputs) and two backward, over the tokens the tensor group holds (its
      devices hold the same ones: per_device_batch_size x T x t);
    - context c: per layer the sequence's key/value state gathered forward and again when the
      backward replays it, and its gradient reduce-scattered (float32, twice the bytes): MLA's
      latent and RoPE key, GQA's keys and values, over the group's c x per_device_batch_size
      sequences."""
    layers = c.num_dense_layers + c.num_moe_layers
    tokens = c.per_device_batch_size * c.max_target_length
    out = 0.0
    if tensor > 1:
        out += layers * 4 * 2 * (tensor - 1) / tensor * tokens * tensor * c.base_emb_dim * 2
    if context > 1:
        if c.attention_type == "mla":
            width = c.kv_lora_rank + c.qk_rope_head_dim
        else:
            width = 2 * c.base_num_kv_heads * c.head_dim
        # two 16-bit gathers and one float32 reduce-scatter: 2 + 2 + 4 bytes per value
        out += layers * (2 + 2 + 4) * (context - 1) / context * tokens * context * width
    return out


def weights(c: Config) -> tuple[float, float]:
    """(dense, routed expert) matmul and embedding weights of the model."""
    d = c.base_emb_dim
    attn = attention_matmul_params(c) * (c.num_dense_layers + c.num_moe_layers)
    dense = attn + c.num_dense_layers * 3 * d * c.base_mlp_dim
    dense += c.num_moe_layers * (3 * d * c.base_moe_mlp_dim * c.shared_experts + d * c.num_experts)
    dense += 2 * c.vocab_size * d
    experts = c.num_moe_layers * c.num_experts * 3 * d * c.base_moe_mlp_dim if c.is_moe else 0
    return float(dense), float(experts)


def expert_weight_traffic(c: Config, expert: int, tensor: int, chunks: int, replay: float) -> float:
    """HBM bytes per device and step that the routed experts' weights take: each of `chunks`
    token chunks reads the device's local experts' 16-bit weights (all MoE layers' experts over
    `expert` x `tensor`) for its forward, for the backward's input gradient and, where the
    backward replays the FFN (`replay`, 0 to 1), once more; and adds its weight gradient into a
    `grad_dtype` accumulator (read and written), which one chunk only writes."""
    local = weights(c)[1] / (max(1, expert) * max(1, tensor))  # 0 without experts
    grad = DTYPE_BYTES.get(str(c.grad_dtype), 4)
    reads = chunks * 2 * (2 + replay)
    accumulate = 2 * grad * chunks if chunks > 1 else grad
    return local * (reads + accumulate)


def recompute_share(c: Config) -> float:
    """The fraction of the layers' forward FLOPs the backward pass recomputes under `c`'s
    remat policy (its presets or custom placements, the paged stash's stack included)."""
    place = remat.config_placements(c)
    kept = remat.names_kept(c)
    total = recomputed = 0.0
    for stack, layers in (("dense", c.num_dense_layers), ("moe", c.num_moe_layers)):
        if not layers:
            continue
        parts = layer_forward_flops(c, moe=stack == "moe")
        total += layers * sum(parts.values())
        redo = placements.recomputed_parts(place, kept.get(stack, []))
        recomputed += layers * sum(parts[p] for p in redo)
    return recomputed / total if total else 0.0


def attention_chunk_share(c: Config) -> float:
    """The forward FLOPs that query chunks (`num_attention_token_chunks` > 1) add to the
    recompute, as a share of the layers' forward FLOPs: each chunk's backward replays its
    projections and kernel once more (counted whole: the keys' projections are not replayed,
    a small overcount)."""
    total = extra = 0.0
    for moe, layers in ((False, c.num_dense_layers), (True, c.num_moe_layers)):
        parts = layer_forward_flops(c, moe=moe)
        total += layers * sum(parts.values())
        extra += layers * (parts["qkv"] + parts["out"] + parts["kernel"])
    return extra / total if total else 0.0


class Model:
    """The step-time model of one search: the model's FLOPs per device and its layers' forward
    FLOPs (the same for every candidate of a config), the chip's peak and host link."""

    def __init__(self, c: Config, chip=None, devices: int = 1):
        self.c = c
        # Muon's Newton-Schulz, shared evenly by the devices (train/muon_layout.py)
        self.optimizer = (
            muon.newton_schulz_flops(c, decoder.spec(c)) / devices if c.opt_type == "muon" else 0.0
        )
        tokens = c.per_device_batch_size * c.max_target_length
        self.model = train_flops_per_token(c) * tokens
        self.forward = tokens * sum(
            n * sum(layer_forward_flops(c, moe=moe).values())
            for moe, n in ((False, c.num_dense_layers), (True, c.num_moe_layers))
        )
        # the routed experts' training FLOPs per device (6 per weight of the K experts a token
        # takes; the recompute of their forward adds a third more, in `of`)
        d, f, k = c.base_emb_dim, c.base_moe_mlp_dim, c.num_experts_per_tok
        self.routed = 6 * 3 * d * f * k * tokens * c.num_moe_layers if c.is_moe else 0.0
        self.peak = chip.peak_bf16_flops if chip is not None else 1e12
        self.hbm = getattr(chip, "hbm_bytes_per_s", None) or float("inf")
        host = getattr(chip, "host", None)
        self.rate = host.link_bytes_per_s if host is not None else float("inf")
        self.link = "none (CPU proxy)" if host is None else f"{host.link}, {self.rate / 1e9:g} GB/s"

    def of(
        self,
        share: float,
        terms: Terms,
        host_ratio: float = 1.0,
        padding: float = 0.0,
        comm_s: float = 0.0,
        overrides: dict | None = None,
    ) -> StepTime:
        """A candidate whose remat choice recomputes `share` of the layers' forward FLOPs and
        whose estimate is `terms`, its grouped matmuls computing `padding` more than their rows
        (`grouped_padding`), its collectives taking `comm_s` (the CPU proxy: a peak of 1
        TFLOP/s, transfers free); `overrides` (its layout and chunks) give the bytes its tensor
        and context splits exchange (`exchange_bytes`) and the experts' weight traffic
        (`expert_weight_traffic`, free on the CPU proxy)."""
        recompute = share * self.forward
        waste = padding * self.routed * (1 + share / 3)
        compute = (self.model + recompute + waste + self.optimizer) / (self.peak * ASSUMED_MFU)
        # Each direction once (written in the forward, read in the backward), a layer's
        # transfer beside another layer's compute: the step takes the longer of the two.
        act = host_ratio * terms.residual_host / self.rate
        state = 2 * terms.state_host / self.rate  # in for the update, the updated state out
        o = overrides or {}
        exchange = self.exchange(o)
        traffic = expert_weight_traffic(
            self.c,
            o.get("ici_expert_parallelism", 1),
            o.get("ici_tensor_parallelism", 1),
            o.get(CHUNKS_KEY, 1),
            min(1.0, share),
        )
        routed = self.routed * (1 + share / 3) / (self.peak * ASSUMED_MFU)
        memory = max(0.0, traffic / self.hbm - routed)
        return StepTime(
            self.model,
            recompute,
            compute,
            act,
            state,
            self.link,
            exchange,
            comm_s,
            memory,
            self.optimizer,
        )

    def exchange(self, overrides: dict) -> float:
        """`exchange_bytes` of a candidate's tensor and context splits."""
        tensor = overrides.get("ici_tensor_parallelism", 1)
        return exchange_bytes(self.c, tensor, overrides.get("ici_context_parallelism", 1))

    def compiled(self, step: StepTime, compiled_flops: float | None) -> StepTime:
        """`step` with its compute from a compiled program's FLOPs (planner/flops.py: what the
        program computes, its recompute and its kernels' padding included)."""
        if not compiled_flops:
            return step
        compute = compiled_flops / (self.peak * ASSUMED_MFU)
        return dataclasses.replace(step, compute_s=compute)


def grouped_padding(c: Config, expert: int, chunks: int, on: str) -> float:
    """The share of extra work the grouped-matmul kernels of `on` do beyond their rows, under
    balanced routing with `expert` shards and `chunks` token chunks: each local expert's group
    of r = tokens x K x expert / E rows (a chunk's) is covered by whole row tiles (megablox on
    TPU: the largest power of two <= r, 16 to 512; tokamax's Triton kernel on GPU: <= 128; the
    tiled CPU loop: 512 rows down to 8, nn/moe/gmm.py), so the last tile of a group computes
    its padding too (planner/kernels.py counts the same in the compiled program)."""
    if not c.is_moe or not c.sparse_matmul:
        return 0.0
    tokens = c.per_device_batch_size * c.max_target_length / chunks
    r = tokens * c.num_experts_per_tok * max(1, expert) / c.num_experts
    if r < 1:
        return 0.0
    floor = 1 << (int(r).bit_length() - 1)
    tile = {"tpu": min(512, max(16, floor)), "gpu": min(128, max(16, floor))}.get(on, 8)
    return math.ceil(r / tile) * tile / r - 1
