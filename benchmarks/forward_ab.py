"""Decode throughput and train step time of two source trees of expertax, on CPU, in one run.

For a change of code that must not change speed (a refactor: docs/design/forward.md): each tree's
`src` is put on PYTHONPATH of a child process (`--probe`) that measures, on one CPU device,
- decode tokens/s of `expertax.decoding.generate` (greedy, float32 as benchmarks/generate.py:
  our CPU kernel serves the decode products; random weights drawn from the specs' initializers,
  prompts of `--prompt-length` random tokens, the call timed at 1 and at `--new-tokens` new
  tokens after a warm-up call of each: batch x (N - 1) / (t_N - t_1), the median over
  `--repeats` calls), for deepseek3-small at batch 1 and 8 and mixtral-tiny at 8;
- the train step time of the default training (synthetic data, per_device_batch_size=2,
  T=128, float32) of deepseek3-tiny and mixtral-tiny: the median over steps 3..`--steps`.
The children alternate between the trees for `--rounds` rounds (the order reversed every other
round), so that a slow spell of the machine falls on both. Measure alone.

Run: python benchmarks/forward_ab.py --tree before=/path/to/old --tree after=. [--rounds 2]
     [--json PATH] [--only MODEL ...] [--new-tokens N] [--repeats N] [--steps N]
Prints JSON lines (one per child: the tree, its commit, the figures), then a Markdown table of
each tree's median over its rounds and the ratio of the last tree to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DECODE = (("deepseek3-small", 1), ("deepseek3-small", 8), ("mixtral-tiny", 8))
TRAIN = ("deepseek3-tiny", "mixtral-tiny")


def probe(args) -> dict:
    import jax
    import numpy as np

    from expertax import load_config
    from expertax.data.synthetic import SyntheticData
    from expertax.decoding import generate, prepare
    from expertax.models import decoder
    from expertax.nn.param import is_spec
    from expertax.train.trainer import build_trainer

    device = jax.devices()[0]
    out: dict = {"decode_tok_s": {}, "train_step_s": {}}
    for name, batch in _chosen(DECODE, args.only, lambda case: case[0]):
        c = load_config(
            overrides={"model_name": name, "max_target_length": 256, "dtype": "float32",
                       "weight_dtype": "float32"}
        )  # fmt: skip
        rng = np.random.default_rng(0)

        def draw(s, rng=rng):
            if s.init == "normal":
                return rng.standard_normal(s.shape, dtype=np.float32) * np.float32(s.scale)
            return (np.ones if s.init == "ones" else np.zeros)(s.shape, np.float32)

        params = prepare(jax.tree.map(draw, decoder.spec(c), is_leaf=is_spec), c, devices=[device])
        prompts = rng.integers(1, c.vocab_size, (batch, args.prompt_length)).tolist()

        def call(n, c=c, params=params, prompts=prompts):
            t0 = time.perf_counter()
            generate(params, c, prompts, max_new_tokens=n, devices=[device])
            return time.perf_counter() - t0

        call(1), call(args.new_tokens)  # compile
        t1 = float(np.median([call(1) for _ in range(args.repeats)]))
        tn = float(np.median([call(args.new_tokens) for _ in range(args.repeats)]))
        out["decode_tok_s"][f"{name} b{batch}"] = batch * (args.new_tokens - 1) / (tn - t1)
    for name in _chosen(TRAIN, args.only, lambda case: case):
        c = load_config(overrides={"model_name": name, "enable_checkpointing": False})
        tr = build_trainer(c, devices=[device])
        state, fn = tr.init_state(), tr.compile()
        data = SyntheticData(
            vocab_size=c.vocab_size, seq_len=c.max_target_length,
            global_batch=int(c.per_device_batch_size), seed=0,
        )  # fmt: skip
        times = []
        with tr.context():
            for i in range(args.steps):
                batch = tr.put_batch(data.batch_at(i))
                t0 = time.perf_counter()
                state, m = fn(state, batch)
                jax.block_until_ready(m["loss"])
                times.append(time.perf_counter() - t0)
        out["train_step_s"][name] = float(np.median(times[2:]))
    return out


def commit_of(tree: Path) -> str:
    run = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)  # fmt: skip
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "src"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return run.stdout.strip() + ("+changes" if dirty else "")


def drive(args) -> None:
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree]
    records = []
    host = {"host": os.uname().nodename, "cpus": os.cpu_count(), "load": os.getloadavg()}
    print(json.dumps(host), flush=True)
    for r in range(args.rounds):
        for label, tree in trees if r % 2 == 0 else trees[::-1]:
            env = dict(os.environ, PYTHONPATH=str(tree / "src"), JAX_PLATFORMS="cpu")
            env.pop("XLA_FLAGS", None)
            child = [sys.executable, __file__, "--probe", *probe_args(args)]
            run = subprocess.run(child, env=env, capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(f"{label}: the probe failed\n{run.stderr[-3000:]}")
            figures = json.loads(run.stdout.splitlines()[-1])
            rec = {"tree": label, "commit": commit_of(tree), "round": r,
                   "load": os.getloadavg()[0], **figures}  # fmt: skip
            records.append(rec)
            line = json.dumps(rec)
            print(line, flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(line + "\n")
    print(table(records, [t[0] for t in trees]))


def _chosen(cases, only: list[str] | None, model_of) -> list:
    """The cases of the models named by `--only` (all without it)."""
    return [case for case in cases if not only or model_of(case) in only]


def probe_args(args) -> list[str]:
    only = ["--only", *args.only] if args.only else []
    return ["--prompt-length", str(args.prompt_length), "--new-tokens", str(args.new_tokens),
            "--repeats", str(args.repeats), "--steps", str(args.steps), *only]  # fmt: skip


def table(records: list[dict], labels: list[str]) -> str:
    import statistics

    def med(label, kind, key):
        return statistics.median(r[kind][key] for r in records if r["tree"] == label)

    first, last = labels[0], labels[-1]
    rows = [
        f"| figure | {' | '.join(labels)} | {last} / {first} |",
        "|---|" + "---:|" * (len(labels) + 1),
    ]
    for kind, unit, keys in (("decode_tok_s", "decode tok/s", [f"{n} b{b}" for n, b in DECODE]),
                             ("train_step_s", "train step s", list(TRAIN))):  # fmt: skip
        for key in [k for k in keys if k in records[0][kind]]:
            vals = [med(label, kind, key) for label in labels]
            cells = " | ".join(f"{v:.4g}" for v in vals)
            rows.append(f"| {unit}, {key} | {cells} | {vals[-1] / vals[0]:.3f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="LABEL=PATH of a source tree")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-length", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument(
        "--only", nargs="+", choices=sorted({n for n, _ in DECODE} | set(TRAIN)),
        help="measure only these models' cases",
    )  # fmt: skip
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe(args)), flush=True)
    else:
        drive(args)


if __name__ == "__main__":
    main()
