"""The optimizer update alone: optax's chained AdamW against `optimizer.apply`, one CPU device.

Both take the same parameters, optimizer state and gradients of a `benchmarks/step_vs_torch.py`
model (float32, clipping on, weight decay masks from the parameter declarations), and do what
the train step does after the backward pass: the update, `apply_updates` and the non-finite
guard, jitted with the state donated. The two are timed in turns (one call each per round,
order flipped every round) in one process; medians. The last line checks that they agree.

Run: python benchmarks/optimizer.py [--models llama,mixtral] [--dims mid|small] [--iters 15]
     [--json PATH] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(__file__))
import step_vs_torch  # noqa: E402
from expertax import hostmem  # noqa: E402
from expertax.models import decoder  # noqa: E402
from expertax.train import optimizer  # noqa: E402
from expertax.train.trainer import build_trainer  # noqa: E402


def optax_chain(c, tx, spec_tree, grads, opt_state, params, finite):
    """The baseline: the update as optax chains it (`optimizer.optax_update`)."""
    return optimizer.optax_update(tx, grads, opt_state, params, finite)


def measure(model: str, dims: dict, iters: int, extra: dict) -> dict:
    c = step_vs_torch.expertax_config(model, dims, "none", extra)
    tr = build_trainer(c, devices=jax.devices()[:1])
    spec_tree = decoder.spec(c)
    with tr.context():
        state = tr.init_state()
        key = jax.random.key(0)
        noise = lambda p: 1e-3 * jax.random.normal(key, p.shape, p.dtype)
        grads = jax.tree.map(noise, state.params)
        fns, states = {}, {}
        for name, update in (("optax", optax_chain), ("fused", optimizer.apply)):

            def step(po, g, update=update):
                finite = jnp.isfinite(optax.tree.norm(g))
                return update(c, tr.tx, spec_tree, g, po[1], po[0], finite)

            fns[name] = jax.jit(step, donate_argnums=0)
            states[name] = jax.tree.map(jnp.copy, (state.params, state.opt_state))
            for _ in range(2):
                states[name] = jax.block_until_ready(fns[name](states[name], grads))
        times: dict[str, list[float]] = {k: [] for k in fns}
        order = list(fns)
        for r in range(iters):
            for name in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                states[name] = jax.block_until_ready(fns[name](states[name], grads))
                times[name].append((time.perf_counter() - t0) * 1e3)
        pairs = zip(jax.tree.leaves(states["optax"][0]), jax.tree.leaves(states["fused"][0]))
        diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    optax_ms, fused_ms = (statistics.median(times[k]) for k in ("optax", "fused"))
    return dict(
        model=model,
        set=extra,
        params_millions=round(n_params / 1e6, 1),
        optax_ms=round(optax_ms, 1),
        fused_ms=round(fused_ms, 1),
        ratio=round(fused_ms / optax_ms, 2),
        max_param_diff=diff,
        iters=iters,
        load_average=round(os.getloadavg()[0], 2),
        hugepages=hostmem.hugepages_active(),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dims", choices=sorted(step_vs_torch.DIMS), default="mid")
    ap.add_argument("--models", default="llama,mixtral")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--json", help="also append the JSON lines to this file")
    ap.add_argument(
        "--set", action="append", default=[], help="extra config key=value, e.g. mu_dtype=bfloat16"
    )
    args = ap.parse_args()
    # as the `expertax` command runs (expertax.hostmem), and as step_vs_torch.py measures
    hostmem.reexec_with_hugepages([sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    rows = []
    for model in args.models.split(","):
        row = measure(
            model, step_vs_torch.DIMS[args.dims], args.iters, step_vs_torch._parse_sets(args.set)
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"\n| model ({args.dims}) | parameters | optax chain ms | optimizer.apply ms | ratio |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params_millions']} M | {r['optax_ms']} | {r['fused_ms']} "
            f"| {r['ratio']} |"
        )


if __name__ == "__main__":
    main()
