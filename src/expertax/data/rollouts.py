"""Rollouts for reinforcement learning on MoE: the sampler's routing, recorded and replayed.

`expertax generate --record-routing FILE` writes, for every sequence it sampled, the experts
each MoE layer's router chose (and the decode program computed with) for each token: the
prompt's from the prefill, every sampled token's from the decode step that fed it. An RL loop
scores the sequences, adds per-token advantages (`with_advantages`), and builds train batches
(`batch`) whose `routing` the train step imposes under `routing_replay=true` (train/step.py):
the trainer's routers then take the sampler's experts, where ~10% of the decisions would
otherwise differ (Megatron-LM #4168; BENCHMARKS.md "routing replay").

The file is a NumPy `.npz` (`np.load`), version `FORMAT`:

| key | value |
|---|---|
| `format` | the string `FORMAT` |
| `num_sequences`, `num_moe_layers`, `num_experts_per_tok`, `num_experts` | int64 scalars |
| `tokens_<i>` | int32 [T_i]: sequence i, its prompt then its sampled tokens |
| `prompt_length_<i>` | int64 scalar: its prompt's tokens |
| `routing_<i>` | int32 [L_moe, T_i, K]: the experts per MoE layer, token and slot (*) |
| `advantages_<i>` | float32 [T_i], optional: the weight of the loss of predicting token t |

(*) The last token's row is -1: it was sampled, never fed to the model (training does not feed
it either: it is only a target).

Sequences are keyed by their token ids: `match` finds each batch row's recording by its tokens
and refuses a row that was not recorded, so a routing is never replayed on other tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from expertax.errors import ConfigError

FORMAT = "expertax-rollouts-1"


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One sampled sequence: tokens [T], its prompt length, the sampler's routing [L, T, K] and
    optional advantages [T] (of predicting token t)."""

    tokens: np.ndarray
    prompt_length: int
    routing: np.ndarray
    advantages: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Recording:
    rollouts: list[Rollout]
    num_moe_layers: int
    num_experts_per_tok: int
    num_experts: int


def write(path: str | Path, recording: Recording) -> None:
    """Write `recording` as the `.npz` of the module docstring."""
    arrays: dict[str, np.ndarray] = {
        "format": np.array(FORMAT),
        "num_sequences": np.array(len(recording.rollouts)),
        "num_moe_layers": np.array(recording.num_moe_layers),
        "num_experts_per_tok": np.array(recording.num_experts_per_tok),
        "num_experts": np.array(recording.num_experts),
    }
    for i, r in enumerate(recording.rollouts):
        arrays[f"tokens_{i}"] = np.asarray(r.tokens, np.int32)
        arrays[f"prompt_length_{i}"] = np.array(r.prompt_length)
        arrays[f"routing_{i}"] = np.asarray(r.routing, np.int32)
        if r.advantages is not None:
            arrays[f"advantages_{i}"] = np.asarray(r.advantages, np.float32)
    with open(path, "wb") as f:  # (np.savez would append .npz to a path without it)
        np.savez(f, **arrays)  # type: ignore[arg-type]


def read(path: str | Path) -> Recording:
    """The recording at `path`; ConfigError naming it when it is not one, or is inconsistent."""
    where = f"routing recording {str(path)!r}"
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: not readable as .npz ({e})") from None
    with z:
        if "format" not in z or str(z["format"]) != FORMAT:
            raise ConfigError(f"{where}: not an {FORMAT} file (expertax generate --record-routing)")
        head = {k: int(z[k]) for k in ("num_moe_layers", "num_experts_per_tok", "num_experts")}
        rollouts = []
        for i in range(int(z["num_sequences"])):
            adv = z[f"advantages_{i}"] if f"advantages_{i}" in z else None
            rollouts.append(
                Rollout(z[f"tokens_{i}"], int(z[f"prompt_length_{i}"]), z[f"routing_{i}"], adv)
            )
    rec = Recording(rollouts, **head)
    for i, r in enumerate(rec.rollouts):
        _check_rollout(r, rec, f"{where}, sequence {i}")
    return rec


def _check_rollout(r: Rollout, rec: Recording, where: str) -> None:
    t = len(r.tokens)
    want = (rec.num_moe_layers, t, rec.num_experts_per_tok)
    if r.routing.shape != want:
        raise ConfigError(f"{where}: routing of shape {r.routing.shape}, expected {want}")
    if r.advantages is not None and r.advantages.shape != (t,):
        raise ConfigError(f"{where}: {r.advantages.shape[0]} advantages for {t} tokens")
    if not 0 < r.prompt_length <= t:
        raise ConfigError(f"{where}: prompt_length {r.prompt_length} of {t} tokens")
    if r.routing.min(initial=0) < -1 or r.routing.max(initial=0) >= rec.num_experts:
        raise ConfigError(f"{where}: expert ids outside [-1, {rec.num_experts})")


def with_advantages(rec: Recording, advantages: Sequence[Sequence[float]]) -> Recording:
    """`rec` with per-token advantages, one list [T_i] per sequence (a sequence-level reward:
    the same value on every token)."""
    if len(advantages) != len(rec.rollouts):
        raise ConfigError(
            f"{len(advantages)} advantage rows for {len(rec.rollouts)} recorded sequences"
        )
    out = []
    for i, (r, a) in enumerate(zip(rec.rollouts, advantages, strict=True)):
        r = dataclasses.replace(r, advantages=np.asarray(a, np.float32))
        _check_rollout(r, rec, f"sequence {i}")
        out.append(r)
    return dataclasses.replace(rec, rollouts=out)


def check_model(rec: Recording, num_moe_layers: int, k: int, num_experts: int, where: str):
    """ConfigError unless `rec` was recorded by a model of these MoE shapes."""
    got = (rec.num_moe_layers, rec.num_experts_per_tok, rec.num_experts)
    want = (num_moe_layers, k, num_experts)
    if got != want:
        raise ConfigError(
            f"{where}: recorded with (num_moe_layers, num_experts_per_tok, num_experts) = {got}, "
            f"but the model has {want}; record with the model that is trained"
        )


def match(rec: Recording, token_rows: Sequence[Sequence[int]]) -> list[Rollout]:
    """The rollout of each row, found by its token ids; ConfigError naming the first row that
    the recording does not hold (its routing would be another sequence's)."""
    by_tokens = {tuple(int(t) for t in r.tokens): r for r in rec.rollouts}
    out = []
    for i, row in enumerate(token_rows):
        found = by_tokens.get(tuple(int(t) for t in row))
        if found is None:
            raise ConfigError(
                f"routing_replay=true: batch row {i} ({len(row)} tokens, starting "
                f"{list(row)[:6]}) is not a recorded sequence; give its tokens exactly as "
                "`expertax generate --record-routing` sampled them"
            )
        out.append(found)
    return out


def batch(rollouts: Sequence[Rollout], seq_len: int, *, routing: bool = True) -> dict:
    """The train batch of `rollouts` (one row each, right-padded to `seq_len`): inputs (tokens
    0 .. T-2), targets (tokens 1 .. T-1), positions, segment_ids (1 on tokens, 0 padding),
    weights (1 on the sampled targets, 0 on the prompt's and padding), advantages (of each
    target, 0 where absent) and, with `routing`, the recorded routing of each input token,
    int32 [B, seq_len, L_moe, K] (-1 on padding)."""
    b = len(rollouts)
    l_moe, _, k = rollouts[0].routing.shape
    out: dict[str, np.ndarray] = {
        "inputs": np.zeros((b, seq_len), np.int32),
        "targets": np.zeros((b, seq_len), np.int32),
        "positions": np.zeros((b, seq_len), np.int32),
        "segment_ids": np.zeros((b, seq_len), np.int32),
        "weights": np.zeros((b, seq_len), np.float32),
        "advantages": np.zeros((b, seq_len), np.float32),
    }
    routed = np.full((b, seq_len, l_moe, k), -1, np.int32)
    for i, r in enumerate(rollouts):
        n = len(r.tokens) - 1
        if n > seq_len:
            raise ConfigError(
                f"rollout {i}: {len(r.tokens)} tokens, {n} inputs past max_target_length="
                f"{seq_len}; set max_target_length={n} or more"
            )
        out["inputs"][i, :n] = r.tokens[:-1]
        out["targets"][i, :n] = r.tokens[1:]
        out["positions"][i, :n] = np.arange(n)
        out["segment_ids"][i, :n] = 1
        out["weights"][i, r.prompt_length - 1 : n] = 1.0  # targets t >= prompt_length
        if r.advantages is not None:
            out["advantages"][i, :n] = r.advantages[1:]
        routed[i, :n] = np.moveaxis(r.routing[:, :-1], 0, 1)
    if routing:
        out["routing"] = routed
    return out
