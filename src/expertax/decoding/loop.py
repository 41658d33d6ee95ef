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
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from expertax import platform
from expertax.config.checks import ConfigError
from expertax.config.loader import config_rules
from expertax.config.schema import Config
from expertax.decoding import cache as kv
from expertax.decoding import model, sample
from expertax.models import decoder
from expertax.nn import param
from expertax.sharding.mesh import make_mesh
from expertax.sharding.rules import logical_to_spec, use_rules

# Keys of training's execution that decoding does not use, and what it runs instead: no
# pipeline stages or paged stash (the cache step is one scan per stack), dropless MoE, whole
# vocab and token rows per step, parameters in device memory.
DECODING_KEYS = {
    "ici_pipeline_parallelism": 1,
    "dcn_pipeline_parallelism": 1,
    "moe_paged_stash": False,
    "capacity_factor": -1.0,
    "num_moe_token_chunks": 1,
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
) -> None:
    """ConfigError naming the setting, its value and what is valid; nothing is compiled."""
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
        if len(p) > c.max_target_length:
            raise ConfigError(
                f"prompt {i}: {len(p)} tokens, longer than max_target_length="
                f"{c.max_target_length}; shorten it or set max_target_length={len(p)}"
            )
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens}: must be at least 1")
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
            f"max_new_tokens={max_new_tokens}: the longest prompt ({longest} tokens) plus the "
            f"budget is {longest + max_new_tokens} positions, past {where} = {limit}; "
            f"use max_new_tokens <= {max(limit - longest, 0)}"
        )
    if not temperature >= 0:
        raise ConfigError(f"temperature={temperature}: must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p={top_p}: must be in (0, 1]")
    if top_k < 0:
        raise ConfigError(f"top_k={top_k}: must be >= 0 (0 = no top-k filter)")
    kv.check_form(mla_cache)
    if speculative:
        if not c.mtp_num_layers:
            raise ConfigError(
                "speculative=True needs a model with MTP modules (mtp_num_layers > 0); this "
                "model has none"
            )
        if temperature != 0:
            raise ConfigError(
                f"speculative=True with temperature={temperature}: MTP speculative decoding is "
                "greedy (temperature 0) only"
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
) -> Generation:
    """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens.

    Greedy at temperature 0, else sampled (top-k when > 0, top-p when < 1) from `seed`;
    each sequence stops after `eos_id`. `mla_cache`: "compressed" (the latent, absorbed
    up-projections) or "plain" (per-head keys and values) for MLA models. `speculative`: greedy
    decoding with MTP module 1 drafting one token per step (needs mtp_num_layers > 0).
    `devices` (default: all JAX sees) form the model's mesh (its ici_*/dcn_* keys and sharding
    rules), so a model too large for one device is sharded as in training. `max_length`: the
    positions the model takes (default: `position_limit`).
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
    )
    c = decoding_config(config)
    mesh = make_mesh(c, devices)
    rules = config_rules(c)
    batch_spec = logical_to_spec(("batch", "length"), rules, mesh)
    shards = _first_dim_shards(batch_spec, mesh)
    n = len(prompt_ids)
    b = math.ceil(n / shards) * shards
    rows = [list(map(int, p)) for p in prompt_ids] + [list(map(int, prompt_ids[0]))] * (b - n)
    p_len = max(len(r) for r in rows)
    prompts = np.zeros((b, p_len), np.int32)
    for i, r in enumerate(rows):
        prompts[i, : len(r)] = r
    lengths = np.array([len(r) for r in rows], np.int32)

    run = _compiled_run(
        c, mesh, rules, b, p_len, max_new_tokens, float(temperature), int(top_k),
        float(top_p), -1 if eos_id is None else int(eos_id), mla_cache, speculative,
    )  # fmt: skip
    with jax.set_mesh(mesh), use_rules(rules), platform.use(platform.of_mesh(mesh)):
        shardings = param.shardings(decoder.spec(c), mesh, rules)
        params = jax.device_put(params, shardings)
        batch_sh = NamedSharding(mesh, PartitionSpec(batch_spec[0] if len(batch_spec) else None))
        out = run(
            params,
            jax.device_put(prompts, NamedSharding(mesh, batch_spec)),
            jax.device_put(lengths, batch_sh),
            jax.random.key(seed),
        )
    tokens, logprobs, counts, proposed, accepted = jax.device_get(out)
    result_tokens, result_lp, finished = [], [], []
    for i in range(n):
        row = tokens[i, : min(int(counts[i]), max_new_tokens)].tolist()
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        result_tokens.append(row)
        result_lp.append([float(x) for x in logprobs[i, : len(row)]])
        finished.append(eos_id is not None and bool(row) and row[-1] == eos_id)
    return Generation(result_tokens, result_lp, finished, int(proposed), int(accepted))


def _first_dim_shards(spec: PartitionSpec, mesh) -> int:
    first = spec[0] if len(spec) else None
    axes = (first,) if isinstance(first, str) else tuple(first or ())
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    return math.prod(sizes[a] for a in axes)


# Jitted loops by (config, mesh, rules, shapes, settings): a repeated call with the same
# settings and shapes reuses the compiled program.
_RUNS: dict = {}


def _compiled_run(c, mesh, rules, b, p_len, budget, temperature, top_k, top_p, eos, form,
                  speculative):  # fmt: skip
    rules_key = tuple(sorted((k, tuple(v)) for k, v in rules.items()))
    key = (c.model_dump_json(), mesh, rules_key, b, p_len, budget, temperature, top_k, top_p,
           eos, form, speculative)  # fmt: skip
    if key not in _RUNS:
        body = _speculative_loop if speculative else _plain_loop
        _RUNS[key] = jax.jit(
            functools.partial(
                body,
                c=c,
                budget=budget,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                eos=eos,
                form=form,
            )  # fmt: skip
        )
    return _RUNS[key]


def _at(a_BT, index_B):
    """a[b, index_b] for each b (a: [B, T, ...])."""
    return jax.vmap(lambda row, i: row[i])(a_BT, index_B)


def _prefill(params, prompts_BP, lengths_B, c, *, form, speculative, extra: int, budget: int):
    b, p_len = prompts_BP.shape
    cache = kv.allocate(c, b, p_len + budget + extra, form, mtp=speculative)
    zeros_B = jnp.zeros((b,), jnp.int32)
    h_BPD, cache = model.main_step(params, prompts_BP, zeros_B, cache, c, form)
    logits_BV = model.logits(params, _at(h_BPD, lengths_B - 1), c)
    return h_BPD, logits_BV, cache


def _plain_loop(params, prompts_BP, lengths_B, key, *, c, budget, temperature, top_k, top_p,
                eos, form):  # fmt: skip
    b = prompts_BP.shape[0]
    _, logits_BV, cache = _prefill(
        params, prompts_BP, lengths_B, c, form=form, speculative=False, extra=0, budget=budget
    )

    def pick(logits_BV, i):
        tok_B = sample.choose(logits_BV, jax.random.fold_in(key, i), temperature, top_k, top_p)
        return tok_B, sample.log_prob(logits_BV, tok_B)

    first_B, lp_B = pick(logits_BV, 0)
    tokens_BN = jnp.zeros((b, budget), jnp.int32).at[:, 0].set(first_B)
    logprobs_BN = jnp.zeros((b, budget), jnp.float32).at[:, 0].set(lp_B)
    done_B = first_B == eos

    def cond(state):
        i, _, _, _, done_B = state
        return jnp.logical_and(i < budget, jnp.logical_not(jnp.all(done_B)))

    def step(state):
        i, cache, tokens_BN, logprobs_BN, done_B = state
        last_B1 = tokens_BN[:, i - 1][:, None]
        h_B1D, cache = model.main_step(params, last_B1, lengths_B + i - 1, cache, c, form)
        tok_B, lp_B = pick(model.logits(params, h_B1D[:, 0], c), i)
        tokens_BN = tokens_BN.at[:, i].set(tok_B)
        logprobs_BN = logprobs_BN.at[:, i].set(lp_B)
        return i + 1, cache, tokens_BN, logprobs_BN, done_B | (tok_B == eos)

    state = (jnp.int32(1), cache, tokens_BN, logprobs_BN, done_B)
    i, _, tokens_BN, logprobs_BN, _ = jax.lax.while_loop(cond, step, state)
    counts_B = jnp.full((b,), i, jnp.int32)
    return tokens_BN, logprobs_BN, counts_B, jnp.int32(0), jnp.int32(0)


def _speculative_loop(params, prompts_BP, lengths_B, key, *, c, budget, temperature, top_k,
                      top_p, eos, form):  # fmt: skip
    del key, temperature, top_k, top_p  # greedy only (check_request)
    b, p_len = prompts_BP.shape
    h_BPD, logits_BV, cache = _prefill(
        params, prompts_BP, lengths_B, c, form=form, speculative=True, extra=2, budget=budget
    )
    first_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    # MTP over the prompt: position i reads t_(i+1) (the first new token at len_b - 1).
    idx_P = jnp.arange(p_len, dtype=jnp.int32)
    shifted_BP = jnp.concatenate([prompts_BP[:, 1:], prompts_BP[:, :1]], axis=1)
    next_BP = jnp.where(idx_P[None] == lengths_B[:, None] - 1, first_B[:, None], shifted_BP)
    zeros_B = jnp.zeros((b,), jnp.int32)
    x_BPD, cache = model.mtp_step(params, h_BPD, next_BP, zeros_B, cache, c, form)
    draft_B = jnp.argmax(model.logits(params, _at(x_BPD, lengths_B - 1), c), -1).astype(jnp.int32)

    width = budget + 2
    tokens_BN = jnp.zeros((b, width), jnp.int32).at[:, 0].set(first_B)
    logprobs_BN = (
        jnp.zeros((b, width), jnp.float32).at[:, 0].set(sample.log_prob(logits_BV, first_B))
    )
    count_B = jnp.ones((b,), jnp.int32)  # tokens kept so far
    done_B = first_B == eos

    def active(count_B, done_B):
        return jnp.logical_and(count_B < budget, jnp.logical_not(done_B))

    def cond(state):
        return jnp.any(active(state[3], state[4]))

    def step(state):
        cache, tokens_BN, logprobs_BN, count_B, done_B, draft_B, proposed, accepted = state
        live_B = active(count_B, done_B)
        last_B = _at(tokens_BN, count_B - 1)
        start_B = lengths_B + count_B - 1  # the position of the last kept token
        in_B2 = jnp.stack([last_B, draft_B], axis=1)
        h_B2D, cache = model.main_step(params, in_B2, start_B, cache, c, form)
        logits_B2V = model.logits(params, h_B2D, c)
        choice_B2 = jnp.argmax(logits_B2V, axis=-1).astype(jnp.int32)
        lp_B2 = jax.vmap(sample.log_prob, in_axes=1, out_axes=1)(logits_B2V, choice_B2)
        ok_B = jnp.logical_and(choice_B2[:, 0] == draft_B, choice_B2[:, 0] != eos)
        write = functools.partial(jax.vmap(lambda row, new, at: jax.lax.dynamic_update_slice(
            row, new, (at,))))  # fmt: skip
        tokens_BN = write(tokens_BN, choice_B2, count_B)
        logprobs_BN = write(logprobs_BN, lp_B2, count_B)
        kept_B = 1 + ok_B.astype(jnp.int32)
        new_last_B = jnp.where(ok_B, choice_B2[:, 1], choice_B2[:, 0])
        x_B2D, cache = model.mtp_step(params, h_B2D, choice_B2, start_B, cache, c, form)
        draft_logits = model.logits(params, _at(x_B2D, ok_B.astype(jnp.int32)), c)
        finished_B = jnp.logical_or(
            choice_B2[:, 0] == eos, jnp.logical_and(ok_B, new_last_B == eos)
        )
        return (
            cache,
            tokens_BN,
            logprobs_BN,
            jnp.where(live_B, count_B + kept_B, count_B),
            done_B | (live_B & finished_B),
            jnp.argmax(draft_logits, axis=-1).astype(jnp.int32),
            proposed + jnp.sum(live_B),
            accepted + jnp.sum(live_B & ok_B),
        )

    state = (cache, tokens_BN, logprobs_BN, count_B, done_B, draft_B, jnp.int32(0), jnp.int32(0))
    _, tokens_BN, logprobs_BN, count_B, _, _, proposed, accepted = jax.lax.while_loop(
        cond, step, state
    )
    return tokens_BN, logprobs_BN, count_B, proposed, accepted
