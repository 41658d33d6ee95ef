"""The jitted decoding programs: prefill then the plain or the speculative decode loop.

See decoding/loop.py for the algorithm. `jitted` caches one jitted program per (config, mesh,
rules, shapes, settings); `compile_for` lowers and compiles one for a mesh of any platform
(compile-only targets: its memory analysis is the plan of sampling on that hardware).
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from expertax import platform
from expertax.config.loader import config_rules
from expertax.config.schema import Config
from expertax.decoding import cache as kv
from expertax.decoding import model, rowdot, sample, weights
from expertax.sharding.rules import logical_to_spec, use_rules


@contextlib.contextmanager
def context(mesh, rules):
    """The mesh, the sharding rules and the platform the programs are traced for."""
    on = platform.use(platform.of_mesh(mesh), mesh.devices.flat[0])
    with jax.set_mesh(mesh), use_rules(rules), on, rowdot.use(rowdot.wanted(mesh)):
        yield


def first_dim_shards(spec: PartitionSpec, mesh) -> int:
    """Shards of a PartitionSpec's first dimension."""
    first = spec[0] if len(spec) else None
    axes = (first,) if isinstance(first, str) else tuple(first or ())
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    return math.prod(sizes[a] for a in axes)


# Jitted loops by (config, mesh, rules, shapes, settings): a repeated call with the same
# settings and shapes reuses the compiled program.
_RUNS: dict = {}


def jitted(c, mesh, rules, b, p_len, budget, temperature, top_k, top_p, eos, form,
           speculative, chunk=None, record=False):  # fmt: skip
    """The jitted loop: (tokens [B, N], log-probs [B, N], counts [B], drafts proposed and
    accepted, and with `record` (plain loop only) the experts each MoE layer used per position,
    int32 [B, P + N, L_moe, K]: slot j the token at position j, -1 where none was fed)."""
    chunk = chunk or PREFILL_CHUNK
    rules_key = tuple(sorted((k, tuple(v)) for k, v in rules.items()))
    key = (c.model_dump_json(), mesh, rules_key, b, p_len, budget, temperature, top_k, top_p,
           eos, form, speculative, chunk, rowdot.wanted(mesh), record)  # fmt: skip
    if key not in _RUNS:
        body = _speculative_loop if speculative else functools.partial(_plain_loop, record=record)
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
                chunk=chunk,
            )  # fmt: skip
        )
    return _RUNS[key]


def _at(a_BT, index_B):
    """a[b, index_b] for each b (a: [B, T, ...])."""
    return jax.vmap(lambda row, i: row[i])(a_BT, index_B)


# Prompts longer than this (the default of `generate`'s `prefill_chunk`) are prefilled a chunk
# of positions at a time (one `lax.scan`), so the prefill's activations, MoE row buffers and
# attention scores ([B, H, chunk, slots]) are a chunk's.
PREFILL_CHUNK = 512


def padded_length(p_len: int, chunk: int | None = None) -> int:
    """The prompt buffer's length: the longest prompt, rounded up to whole prefill chunks."""
    chunk = chunk or PREFILL_CHUNK
    return p_len if p_len <= chunk else math.ceil(p_len / chunk) * chunk


def _in_chunks(fn, cache, chunk: int, *arrays_BP):
    """fn(*chunks [B, C, ...], start_B, cache) -> (out [B, C, ...], cache) over the positions
    of `arrays_BP`, `chunk` at a time; returns (out [B, P, ...], cache). `out` may be a pytree
    of such arrays."""
    b, p_len = arrays_BP[0].shape[:2]
    chunk = min(p_len, chunk)

    def body(cache, i):
        start = i * chunk
        parts = [jax.lax.dynamic_slice_in_dim(a, start, chunk, axis=1) for a in arrays_BP]
        out, cache = fn(*parts, jnp.full((b,), start, jnp.int32), cache)
        return cache, out

    cache, outs = jax.lax.scan(body, cache, jnp.arange(p_len // chunk, dtype=jnp.int32))
    joined = lambda o: jnp.moveaxis(o, 0, 1).reshape(b, p_len, *o.shape[3:])  # noqa: E731
    return jax.tree.map(joined, outs), cache


def _prefill(params, prompts_BP, lengths_B, c, *, form, speculative, extra: int, budget: int,
             chunk: int, record: bool = False):  # fmt: skip
    """(hidden states [B, P, D], the first new token's logits [B, V], the cache, and with
    `record` the experts the MoE layers used per prompt position [B, P, L_moe, K], else None)."""
    b, p_len = prompts_BP.shape
    cache = kv.allocate(c, b, p_len + budget + extra, form, mtp=speculative)

    def main(tokens_BC, start_B, cache):  # attention over the prompt's slots only
        h, cache, chosen = model.routed_step(
            params, tokens_BC, start_B, cache, c, slots=p_len, record=record
        )
        return (h, chosen), cache

    (h_BPD, chosen_BPLK), cache = _in_chunks(main, cache, chunk, prompts_BP)
    logits_BV = model.logits(params, _at(h_BPD, lengths_B - 1), c)
    if record:
        return h_BPD, logits_BV, cache, chosen_BPLK
    return h_BPD, logits_BV, cache


def _plain_loop(params, prompts_BP, lengths_B, key, *, c, budget, temperature, top_k, top_p,
                eos, form, chunk, record=False):  # fmt: skip
    b, p_len = prompts_BP.shape
    _, logits_BV, cache, *prompt_routing = _prefill(
        params,
        prompts_BP,
        lengths_B,
        c,
        form=form,
        speculative=False,
        extra=0,
        budget=budget,
        chunk=chunk,
        record=record,
    )
    # the routing used at each position (recording): the prompt's from the prefill, then each
    # decode step's fed token at its own position (slots past a prompt's end are overwritten
    # before the sequence's own steps reach them, as in the KV cache)
    routing = None
    if record and prompt_routing[0] is not None:
        l_moe, k = prompt_routing[0].shape[2:]
        routing = jnp.full((b, p_len + budget, l_moe, k), -1, jnp.int32)
        routing = routing.at[:, :p_len].set(prompt_routing[0])

    def pick(logits_BV, i):
        tok_B = sample.choose(logits_BV, jax.random.fold_in(key, i), temperature, top_k, top_p)
        return tok_B, sample.log_prob(logits_BV, tok_B)

    first_B, lp_B = pick(logits_BV, 0)
    tokens_BN = jnp.zeros((b, budget), jnp.int32).at[:, 0].set(first_B)
    logprobs_BN = jnp.zeros((b, budget), jnp.float32).at[:, 0].set(lp_B)
    done_B = first_B == eos

    def cond(state):
        i, _, _, _, done_B, _ = state
        return jnp.logical_and(i < budget, jnp.logical_not(jnp.all(done_B)))

    def step(state):
        i, cache, tokens_BN, logprobs_BN, done_B, routing = state
        last_B1 = tokens_BN[:, i - 1][:, None]
        at_B = lengths_B + i - 1
        h_B1D, cache, chosen_B1LK = model.routed_step(
            params, last_B1, at_B, cache, c, record=routing is not None
        )
        if routing is not None:
            routing = routing.at[jnp.arange(b), at_B].set(chosen_B1LK[:, 0])
        tok_B, lp_B = pick(model.logits(params, h_B1D[:, 0], c), i)
        tokens_BN = tokens_BN.at[:, i].set(tok_B)
        logprobs_BN = logprobs_BN.at[:, i].set(lp_B)
        return i + 1, cache, tokens_BN, logprobs_BN, done_B | (tok_B == eos), routing

    state = (jnp.int32(1), cache, tokens_BN, logprobs_BN, done_B, routing)
    i, _, tokens_BN, logprobs_BN, _, routing = jax.lax.while_loop(cond, step, state)
    counts_B = jnp.full((b,), i, jnp.int32)
    out = (tokens_BN, logprobs_BN, counts_B, jnp.int32(0), jnp.int32(0))
    return (*out, routing) if record else out


def _speculative_loop(params, prompts_BP, lengths_B, key, *, c, budget, temperature, top_k,
                      top_p, eos, form, chunk):  # fmt: skip
    del key, temperature, top_k, top_p  # greedy only (check_request)
    b, p_len = prompts_BP.shape
    h_BPD, logits_BV, cache = _prefill(
        params,
        prompts_BP,
        lengths_B,
        c,
        form=form,
        speculative=True,
        extra=2,
        budget=budget,
        chunk=chunk,
    )
    first_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    # MTP over the prompt: position i reads t_(i+1) (the first new token at len_b - 1).
    idx_P = jnp.arange(p_len, dtype=jnp.int32)
    shifted_BP = jnp.concatenate([prompts_BP[:, 1:], prompts_BP[:, :1]], axis=1)
    next_BP = jnp.where(idx_P[None] == lengths_B[:, None] - 1, first_B[:, None], shifted_BP)

    def mtp(h_BCD, next_BC, start_B, cache):
        return model.mtp_step(params, h_BCD, next_BC, start_B, cache, c, slots=p_len)

    x_BPD, cache = _in_chunks(mtp, cache, chunk, h_BPD, next_BP)
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
        h_B2D, cache = model.main_step(params, in_B2, start_B, cache, c)
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
        x_B2D, cache = model.mtp_step(params, h_B2D, choice_B2, start_B, cache, c)
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


def compile_for(
    c: Config, mesh, *, batch: int, prompt_len: int, budget: int, form: str = "compressed",
    speculative: bool = False, fp8_weights: bool = False, prefill_chunk: int | None = None,
):  # fmt: skip
    """The greedy decoding program (prefill of `batch` x `prompt_len` in `prefill_chunk`
    positions at a time, `budget` new tokens) lowered and compiled for `mesh` (any platform;
    nothing runs). `c` is a decoding config (loop.decoding_config); `batch` is rounded up to the
    batch shards."""
    rules = config_rules(c)
    batch_spec = logical_to_spec(("batch", "length"), rules, mesh)
    shards = first_dim_shards(batch_spec, mesh)
    b = math.ceil(batch / shards) * shards
    prompt_len = padded_length(prompt_len, prefill_chunk)
    run = jitted(c, mesh, rules, b, prompt_len, budget, 0.0, 0, 1.0, -1, form, speculative,
                 prefill_chunk)  # fmt: skip
    params = weights.abstract_layered(c, mesh, rules, fp8_weights=fp8_weights)
    first = PartitionSpec(batch_spec[0] if len(batch_spec) else None)
    prompts = jax.ShapeDtypeStruct(
        (b, prompt_len), jnp.int32, sharding=NamedSharding(mesh, batch_spec)
    )
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=NamedSharding(mesh, first))
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    with context(mesh, rules):
        return run.lower(params, prompts, lengths, key).compile()
