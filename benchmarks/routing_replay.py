"""Routing replay: how often a training forward's routers pick other experts than the sampler.

For each case (model, dtype, the sampler's devices, the trainer's layout): random weights, a
batch of prompts sampled at temperature 1 by `expertax.decoding.generate(..., record_routing=
True)` (the decode program's own routers), then the training forward (`decoder.forward`, the
train step's layout and mesh) over the sampled sequences, twice:

- without replay (every entry -1): the routers' own choices, compared with the recorded ones over
  every fed (layer, token, slot); `flips` counts the recorded assignments whose expert the
  trainer did not choose for that token (the order within a token's K does not count);
- with replay (the recording imposed, as `routing_replay=true` does): the experts used are the
  recorded ones (router.route takes every entry >= 0), so the used experts' flips are 0; the
  column counts them from the forward's own outputs (imposed where >= 0, else its choice).

And both forwards' log-probability of each sampled token against the sampler's (`Generation.
logprobs`): the largest and mean |difference| (nats), the train-inference mismatch that RL's
importance ratios see.

Run: PYTHONPATH=src python benchmarks/routing_replay.py [--prompts 8] [--new 24]
Prints one JSON line per case, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from expertax import init_params, load_config  # noqa: E402
from expertax.data import rollouts  # noqa: E402
from expertax.decoding import generate  # noqa: E402
from expertax.models import decoder  # noqa: E402
from expertax.train.step import replay_flips  # noqa: E402
from expertax.train.trainer import build_trainer  # noqa: E402

# (model, dtype, sampler devices, trainer devices, trainer layout keys)
CASES = [
    ("deepseek3-tiny", "float32", 1, 1, {}),
    ("deepseek3-tiny", "bfloat16", 1, 1, {}),
    ("deepseek3-tiny", "bfloat16", 1, 2, {"ici_expert_parallelism": 2}),
    ("deepseek3-tiny", "float32", 8, 2, {"ici_expert_parallelism": 2}),
    ("mixtral-tiny", "float32", 1, 1, {}),
    ("mixtral-tiny", "bfloat16", 1, 1, {}),
    ("mixtral-tiny", "bfloat16", 1, 2, {"ici_expert_parallelism": 2}),
    ("mixtral-tiny", "float32", 8, 2, {"ici_expert_parallelism": 2}),
]


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, rng.integers(4, 13)).tolist() for _ in range(n)]


def layout_name(devices: int, keys: dict) -> str:
    if devices == 1:
        return "1 device"
    return f"{devices} devices " + " ".join(f"{k.split('_')[1]}={v}" for k, v in keys.items())


def measure(model, dtype, sampler_n, trainer_n, keys, n_prompts, new) -> dict:
    devices = jax.devices()
    base = dict(model_name=model, dtype=dtype, weight_dtype="float32", max_target_length=64)
    c = load_config(overrides=base)
    params = init_params(c)
    ps = prompts(n_prompts, c.vocab_size)
    g = generate(
        params, c, ps, max_new_tokens=new, temperature=1.0, seed=1,
        devices=devices[:sampler_n], record_routing=True,
    )  # fmt: skip
    assert g.routing is not None
    rec = [
        rollouts.Rollout(np.asarray(p + t, np.int32), len(p), r)
        for p, t, r in zip(ps, g.tokens, g.routing, strict=True)
    ]
    tc = load_config(
        overrides={
            **base,
            **keys,
            "routing_replay": True,
            "per_device_batch_size": n_prompts / trainer_n,
        }
    )
    trainer = build_trainer(tc, devices[:trainer_n])
    batch = rollouts.batch(rec, tc.max_target_length)
    imposed_BTLK = batch.pop("routing")
    imposed = np.ascontiguousarray(np.moveaxis(imposed_BTLK, 2, 0))  # [L, B, T, K]
    spec = PartitionSpec(None, *trainer.batch_sharding.spec)

    def forward(p, b, imposed_LBTK):
        logits_BTV, stats = decoder.forward(
            p, b["inputs"], tc, positions_BT=b["positions"], segment_ids_BT=b["segment_ids"],
            imposed_LBTK=imposed_LBTK,
        )  # fmt: skip
        lp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
        lp_BT = jnp.take_along_axis(lp_BTV, b["targets"][..., None], axis=-1)[..., 0]
        used = jnp.where(imposed_LBTK >= 0, imposed_LBTK, stats.chosen_BTK)
        return lp_BT, stats.chosen_BTK, used

    with trainer.context():
        p = jax.device_put(params, trainer.state_shardings.params)
        b = {k: jax.device_put(batch[k], trainer.batch_sharding) for k in batch}
        fn = jax.jit(forward)
        none = jax.device_put(np.full_like(imposed, -1), NamedSharding(trainer.mesh, spec))
        rec_dev = jax.device_put(imposed, NamedSharding(trainer.mesh, spec))
        lp_own, chosen_own, _ = jax.device_get(fn(p, b, none))
        lp_rep, _, used_rep = jax.device_get(fn(p, b, rec_dev))

    fed = imposed >= 0
    flips_own = int(np.sum(replay_flips(jnp.asarray(imposed), jnp.asarray(chosen_own))))
    flips_rep = int(np.sum(replay_flips(jnp.asarray(imposed), jnp.asarray(used_rep))))

    def mismatch(lp_BT):
        diffs = []
        for i, (prompt, lps) in enumerate(zip(ps, g.logprobs, strict=True)):
            start = len(prompt) - 1
            diffs.append(np.abs(lp_BT[i, start : start + len(lps)] - np.asarray(lps)))
        d = np.concatenate(diffs)
        return float(d.max()), float(d.mean())

    own_max, own_mean = mismatch(lp_own)
    rep_max, rep_mean = mismatch(lp_rep)
    return {
        "model": model,
        "dtype": dtype,
        "sampler": layout_name(sampler_n, {}) if sampler_n == 1 else f"{sampler_n} devices fsdp",
        "trainer": layout_name(trainer_n, keys),
        "decisions": int(fed.sum()),
        "flips_without_replay": flips_own,
        "flips_with_replay": flips_rep,
        "logprob_diff_max_without": own_max,
        "logprob_diff_mean_without": own_mean,
        "logprob_diff_max_with": rep_max,
        "logprob_diff_mean_with": rep_mean,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=24)
    args = ap.parse_args()
    rows = []
    for case in CASES:
        row = measure(*case, args.prompts, args.new)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(
        "\n| model | dtype | sampler | trainer | decisions | flips without replay | "
        "flips with replay | max / mean abs dlogprob without | with |"
    )
    print("|---|---|---|---|---:|---:|---:|---|---|")
    for r in rows:
        pct = 100 * r["flips_without_replay"] / r["decisions"]
        print(
            f"| {r['model']} | {r['dtype']} | {r['sampler']} | {r['trainer']} | "
            f"{r['decisions']} | {r['flips_without_replay']} ({pct:.2f} %) | "
            f"{r['flips_with_replay']} | {r['logprob_diff_max_without']:.2e} / "
            f"{r['logprob_diff_mean_without']:.2e} | {r['logprob_diff_max_with']:.2e} / "
            f"{r['logprob_diff_mean_with']:.2e} |"
        )


if __name__ == "__main__":
    main()
