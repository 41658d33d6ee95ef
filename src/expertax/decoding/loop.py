"""`generate`: a batched prefill, then a jitted decode loop over the KV cache.

The prompts are right-padded to the longest, P tokens. Prefill runs the model once over [B, P]
(positions 0 .. P-1) and fills the cache; the first new token of sequence b comes from its
hidden state at len_b - 1. Each decode step feeds the last token of each sequence at its own
position len_b + n - 1 (so sequences of different lengths decode together) and stops when every
sequence has met EOS or the budget. The whole loop is one `lax.while_loop` in one jitted call.

Greedy speculative decoding with MTP module 1 (DeepSeek-V3 Sec. 5.4.3): the module drafts
t_(n+2) from the main model's hidden state at n and the embedding of t_(n+1). The next step
feeds [t_(n+1), draft] at positions n+1, n+2: the main model's choice at n+1 is always kept; the
draft is accepted when it equals that choice, and then the main model's choice at n+2 is kept
too (two tokens for one step). Every kept token is the main model's own greedy choice given the
kept tokens before it, so the output is plain greedy decoding's. A rejected draft's cache slot is
written again by the next step before any query reads it.

Under a mesh of several devices the batch is padded to a multiple of its shards with copies of
the first prompt (the MoE layer's expert-parallel dispatch splits tokens over the batch axes);
the padding rows are dropped from the result.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from expertax.config.loader import config_rules
from expertax.config.schema import Config
from expertax.decoding import cache as kv
from expertax.decoding import programs, weights
from expertax.errors import ConfigError
from expertax.models import decoder
from expertax.sharding.mesh import make_mesh
from expertax.sharding.rules import logical_to_spec

# Keys of training's execution that decoding does not use, and what it runs instead: no
# pipeline stages or paged stash (the cache step is one scan per stack), dropless MoE, whole
# vocab and token rows per step, parameters in device memory.
DECODING_KEYS = {
    "ici_pipeline_parallelism": 1,
    "dcn_pipeline_parallelism": 1,
    "moe_paged_stash": False,
    "capacity_factor": -1.0,
    "num_moe_token_chunks": 1,
    "num_attention_token_chunks": 1,
    "num_vocab_tiling": 1,
    "parameter_memory_host_offload": False,
    "optimizer_memory_host_offload": False,
}


@dataclasses.dataclass(frozen=True)
class Generation:
    """What `generate` returns, one entry per prompt."""

    tokens: list[list[int]]  # the new tokens, ending with EOS when one was produced
    logprobs: list[list[float]]  # the model's log-probability of each new token
    finished: list[bool]  # stopped at EOS (else at the token budget)
    drafts_proposed: int = 0  # speculative decoding: MTP drafts verified
    drafts_accepted: int = 0  # ... and accepted
    # `record_routing`: per prompt, int32 [L_moe, T, K] over its T = prompt + new tokens, the
    # experts each MoE layer's router chose (and the step used) for the token at each position;
    # the last new token is never fed to the model, so its row is -1 (decoding/record.py)
    routing: list[np.ndarray] | None = None

    @property
    def acceptance(self) -> float | None:
        """Share of MTP drafts accepted (speculative decoding), else None."""
        if not self.drafts_proposed:
            return None
        return self.drafts_accepted / self.drafts_proposed


def decoding_config(c: Config) -> Config:
    """`c` with training's execution keys replaced by decoding's (DECODING_KEYS)."""
    return c.model_copy(update=DECODING_KEYS)


def position_limit(c: Config) -> int:
    """Positions the model can be asked for: the YaRN range when it extends RoPE, else
    max_target_length."""
    if c.rope_type == "yarn":
        return int(c.original_max_position_embeddings * c.rope_factor)
    return c.max_target_length


def _keyword(setting: str, value: Any) -> str:
    return setting if value is None else f"{setting}={value}"


def check_request(
    c: Config,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    mla_cache: str,
    speculative: bool,
    max_length: int | None = None,
    prefill_chunk: int | None = None,
    say: Callable[[str, Any], str] | None = None,
    record_routing: bool = False,
) -> None:
    """ConfigError naming the setting, its value and what is valid; nothing is compiled.
    `say(setting, value)`: how a message writes a setting (value None: its name alone); by
    default as the keyword, `max_new_tokens=32` (the command line passes its flags')."""
    say = say or _keyword
    if not prompts:
        raise ConfigError("prompts: none given; give at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ConfigError(f"prompt {i}: empty; a prompt needs at least one token")
        bad = [t for t in p if not 0 <= int(t) < c.vocab_size]
        if bad:
            raise ConfigError(
                f"prompt {i}: token ids {bad[:5]} are outside the vocabulary [0, {c.vocab_size})"
            )
        if len(p) > (max_length or c.max_target_length):
            what = (
                f"max_length={max_length}"
                if max_length
                else f"max_target_length={c.max_target_length}"
            )
            raise ConfigError(
                f"prompt {i}: {len(p)} tokens, longer than {what}; shorten it"
                + ("" if max_length else f" or set max_target_length={len(p)}")
            )
    if max_new_tokens < 1:
        raise ConfigError(f"{say('max_new_tokens', max_new_tokens)}: must be at least 1")
    limit = max_length or position_limit(c)
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > limit:
        where = (
            "the YaRN range original_max_position_embeddings x rope_factor"
            if c.rope_type == "yarn" and not max_length
            else "the model's position range (max_target_length, or the hub's "
            "max_position_embeddings)"
        )
        raise ConfigError(
            f"{say('max_new_tokens', max_new_tokens)}: the longest prompt ({longest} tokens) plus "
            f"the budget is {longest + max_new_tokens} positions, past {where} = {limit}; "
            f"use {say('max_new_tokens', None)} <= {max(limit - longest, 0)}"
        )
    if not temperature >= 0:
        raise ConfigError(f"{say('temperature', temperature)}: must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ConfigError(f"{say('top_p', top_p)}: must be in (0, 1]")
    if top_k < 0:
        raise ConfigError(f"{say('top_k', top_k)}: must be >= 0 (0 = no top-k filter)")
    kv.check_form(mla_cache)
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ConfigError(
            f"{say('prefill_chunk', prefill_chunk)}: must be at least 1 (prompt positions per "
            f"prefill step; default {programs.PREFILL_CHUNK})"
        )
    if speculative:
        if not c.mtp_num_layers:
            raise ConfigError(
                f"{say('speculative', True)} needs a model with MTP modules (mtp_num_layers > 0); "
                "this model has none"
            )
        if temperature != 0:
            raise ConfigError(
                f"{say('speculative', True)} with {say('temperature', temperature)}: MTP "
                "speculative decoding is greedy (temperature 0) only"
            )
        if record_routing:
            raise ConfigError(
                f"{say('record_routing', None)} with {say('speculative', True)}: the routing is "
                "recorded by the plain decode loop only (a speculative step routes drafts it may "
                f"reject); leave {say('speculative', None)} out to record"
            )
    if record_routing and not c.is_moe:
        raise ConfigError(
            f"{say('record_routing', None)}: the model has no MoE layers (num_experts="
            f"{c.num_experts}), so there is no routing to record; leave it out"
        )


def generate(
    params: decoder.Decoder,
    config: Config,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    mla_cache: str = "compressed",
    speculative: bool = False,
    devices=None,
    max_length: int | None = None,
    fp8_weights: bool = False,
    prefill_chunk: int | None = None,
    record_routing: bool = False,
) -> Generation:
    """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens.

    Greedy at temperature 0, else sampled (top-k when > 0, top-p when < 1) from `seed`;
    each sequence stops after `eos_id`. `mla_cache`: "compressed" (the latent, absorbed
    up-projections) or "plain" (per-head keys and values) for MLA models. `speculative`: greedy
    decoding with MTP module 1 drafting one token per step (needs mtp_num_layers > 0).
    `devices` (default: all JAX sees) form the model's mesh (its ici_*/dcn_* keys and sharding
    rules), so a model too large for one device is sharded as in training. `max_length`: the
    positions the model takes (default: `position_limit`). `fp8_weights`: hold the layers'
    matrices in fp8 with block scales (decoding/quantized.py), half the memory of bfloat16.
    `prefill_chunk`: prompt positions per prefill step (default `programs.PREFILL_CHUNK`);
    longer prompts are padded to whole chunks. Smaller chunks hold smaller prefill activations.
    `record_routing`: also return the experts the decode program's MoE routers chose for every
    prompt and sampled token (`Generation.routing`; plain loop only, not `speculative`).

    `params` are the model's (stacked, as trained) or `prepare`'s output for the same config
    and devices: decoding holds the layers unstacked (decoding/weights.py), a copy `generate`
    makes on every call unless given prepared parameters.
    """
    check_request(
        config,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        mla_cache=mla_cache,
        speculative=speculative,
        max_length=max_length,
        prefill_chunk=prefill_chunk,
        record_routing=record_routing,
    )
    c = decoding_config(config)
    mesh = make_mesh(c, devices)
    rules = config_rules(c)
    batch_spec = logical_to_spec(("batch", "length"), rules, mesh)
    shards = programs.first_dim_shards(batch_spec, mesh)
    n = len(prompt_ids)
    b = math.ceil(n / shards) * shards
    rows = [list(map(int, p)) for p in prompt_ids] + [list(map(int, prompt_ids[0]))] * (b - n)
    p_len = programs.padded_length(max(len(r) for r in rows), prefill_chunk)
    prompts = np.zeros((b, p_len), np.int32)
    for i, r in enumerate(rows):
        prompts[i, : len(r)] = r
    lengths = np.array([len(r) for r in rows], np.int32)

    run = programs.jitted(
        c, mesh, rules, b, p_len, max_new_tokens, float(temperature), int(top_k),
        float(top_p), -1 if eos_id is None else int(eos_id), mla_cache, speculative,
        prefill_chunk, record_routing,
    )  # fmt: skip
    with programs.context(mesh, rules):
        if not weights.is_layered(params):
            params = weights.layered(params, c, mesh, rules, fp8_weights=fp8_weights)
        batch_sh = NamedSharding(mesh, PartitionSpec(batch_spec[0] if len(batch_spec) else None))
        out = run(
            params,
            jax.device_put(prompts, NamedSharding(mesh, batch_spec)),
            jax.device_put(lengths, batch_sh),
            jax.random.key(seed),
        )
    tokens, logprobs, counts, proposed, accepted, *routed = jax.device_get(out)
    result_tokens, result_lp, finished = [], [], []
    for i in range(n):
        row = tokens[i, : min(int(counts[i]), max_new_tokens)].tolist()
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        result_tokens.append(row)
        result_lp.append([float(x) for x in logprobs[i, : len(row)]])
        finished.append(eos_id is not None and bool(row) and row[-1] == eos_id)
    routing = None
    if record_routing:
        routing = [
            _sequence_routing(routed[0][i], len(rows[i]) + len(result_tokens[i])) for i in range(n)
        ]
    return Generation(result_tokens, result_lp, finished, int(proposed), int(accepted), routing)


def _sequence_routing(routing_SLK: np.ndarray, length: int) -> np.ndarray:
    """One sequence's recorded routing [L_moe, T, K] from the loop's [slots, L_moe, K]: its T =
    `length` positions, the last (a sampled token never fed) -1."""
    out = np.array(routing_SLK[:length], np.int32)
    out[length - 1] = -1
    return np.ascontiguousarray(np.moveaxis(out, 1, 0))


def prepare(params: decoder.Decoder, config: Config, *, devices=None, fp8_weights: bool = False):
    """The parameters as `generate` holds them (one buffer per layer on the model's mesh over
    `devices`, fp8 when asked), to pass to repeated `generate` calls with the same config and
    devices."""
    c = decoding_config(config)
    mesh = make_mesh(c, devices)
    rules = config_rules(c)
    with programs.context(mesh, rules):
        return weights.layered(params, c, mesh, rules, fp8_weights=fp8_weights)
