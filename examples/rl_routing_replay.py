"""Reinforcement learning on MoE with routing replay, end to end on a tiny model.

    python examples/rl_routing_replay.py [WORK_DIR]

1. A random deepseek3-tiny is saved as an expertax model directory (in practice: a training run
   folder or `expertax convert from-hf`'s output).
2. `expertax generate DIR --temperature 1 --record-routing rollouts.npz` samples continuations
   and records, per sequence, the experts each MoE layer's router used for every token
   (expertax/data/rollouts.py describes the file).
3. A toy reward scores each continuation (the share of even token ids); the advantage of a
   sequence is its reward minus the batch's mean (GRPO-style), on every sampled token.
4. One train step with `routing_replay=true token_advantages=true`: the batch's recorded
   routing is imposed on the MoE layers, the advantages weight each token's cross-entropy
   (the policy-gradient surrogate), and the step's metric `routing_replay_flips` counts the
   assignments the trainer's routers would have chosen otherwise.

The RL loop (steps 2-4 repeated, the new parameters saved for the sampler) stays outside
expertax; tests/unit/train/test_routing_replay.py runs this file's `main`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from expertax import init_params, load_config
from expertax.cli import main as cli
from expertax.data import rollouts
from expertax.train import model_dir
from expertax.train.trainer import build_trainer

MODEL = dict(model_name="deepseek3-tiny", dtype="float32", weight_dtype="float32")
PROMPTS = ["1,5,9,3,7", "2,4", "11,12,13,14,15,16,17,18,19", "8,6"]
NEW_TOKENS = 8


def save_model(path: Path, seed: int = 0) -> None:
    c = load_config(overrides={**MODEL, "init_weights_seed": seed})
    model_dir.save(path, c, init_params(c), source="examples/rl_routing_replay.py")


def sample(model: Path, out: Path, *overrides: str) -> rollouts.Recording:
    """`expertax generate` with a recording of its routing (step 2)."""
    argv = ["generate", str(model), *overrides, "--max-new-tokens", str(NEW_TOKENS)]
    for p in PROMPTS:
        argv += ["--prompt-ids", p]
    argv += ["--temperature", "1", "--seed", "7", "--record-routing", str(out), "--overwrite"]
    if cli(argv) != 0:
        raise SystemExit("expertax generate failed")
    return rollouts.read(out)


def score(rec: rollouts.Recording) -> list[np.ndarray]:
    """Per-token advantages: reward (share of even ids among the new tokens) minus the mean."""
    rewards = [np.mean(r.tokens[r.prompt_length :] % 2 == 0) for r in rec.rollouts]
    mean = float(np.mean(rewards))
    return [np.full(len(r.tokens), w - mean, np.float32) for r, w in zip(rec.rollouts, rewards)]


def make_trainer(model: Path, rec: rollouts.Recording, devices=None, **keys):
    """The trainer of `model` for a batch of the recorded sequences with `routing_replay` and
    `token_advantages` on (step 4), its parameters read from `model`, and its jitted step."""
    saved = model_dir.read_config(model)
    devices = devices or jax.devices()[:1]
    c = saved.model_copy(
        update=dict(
            routing_replay=True,
            token_advantages=True,
            per_device_batch_size=len(rec.rollouts) / len(devices),
            max_target_length=16,
            **keys,
        )
    )
    rollouts.check_model(rec, c.num_moe_layers, c.num_experts_per_tok, c.num_experts, "example")
    trainer = build_trainer(c, devices)
    _, params, _ = model_dir.load(model, trainer.state_shardings.params)
    return trainer, params, trainer.jitted_step()


def run_step(trainer, params, step_fn, batch: dict) -> dict:
    """One train step from `params` (copied: the step donates its state) on `batch`; its
    metrics as host values."""
    state = trainer.init_state(jax.tree.map(jnp.copy, params))
    with trainer.context():
        _, metrics = step_fn(state, trainer.put_batch(batch))
    return jax.device_get(metrics)


def replay_batch(trainer, rec: rollouts.Recording) -> dict:
    """The train batch of the recorded sequences, each row's routing found by its tokens."""
    rows = rollouts.match(rec, [r.tokens for r in rec.rollouts])
    return rollouts.batch(rows, trainer.c.max_target_length)


def main(work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not model.exists():
        save_model(model)
    rec = sample(model, work / "rollouts.npz")
    rec = rollouts.with_advantages(rec, score(rec))
    rollouts.write(work / "scored.npz", rec)  # what the RL loop hands to the trainer
    scored = rollouts.read(work / "scored.npz")
    trainer, params, step_fn = make_trainer(model, scored)
    metrics = run_step(trainer, params, step_fn, replay_batch(trainer, scored))
    print(
        f"loss {float(metrics['loss']):.4f}, routing flips {int(metrics['routing_replay_flips'])}"
        f", grad norm {float(metrics['grad_norm']):.4f}"
    )
    return metrics


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "rl-routing-replay"))
