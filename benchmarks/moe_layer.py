"""Forward+backward of one MoE layer on 8 (simulated) devices: EP strategies, time and bytes.

For EP = 1, 2, 4, 8 (the rest of the 8 devices on `data`), both sparse strategies (all-to-all
with the backend's implementation, ring of experts), balanced and skewed routing: time per routed
token (fwd+bwd), and bytes each device sends in the dispatch collectives per layer, counted from
the compiled HLO (result shapes and group sizes of all-to-all / all-gather / reduce-scatter, see
`hlo_profile.collective_bytes`; all-reduces, the gradient reductions over `data` and the stats,
are reported apart), against the ideal:
all-to-all 2*k*D*bytes per token each way (forward; twice that with the backward), ring
(EP-1)*N*D*bytes per all-gather and per reduce-scatter (forward; twice with the backward).
Baseline in the same run: the single-device sparse path without a mesh.

Time shares (`--profile`, on by default): for balanced routing at EP = 1 and EP = 8, both
strategies, a few more steps run under `jax.profiler`, and the time of the executed HLO
instructions is summed by category: `sort`, `gather` (gathers and scatters: the permutes, the
row gathers and the scatter-back), `collective` (with its waiting time) and other
(benchmarks/hlo_profile.py).

The script re-executes itself with glibc's malloc on transparent huge pages, as the `expertax`
command runs (`expertax.hostmem`; `--hugepages off` for the C library's default). At length 512
huge pages halved the time per routed token on a 2-core VM (2026-11-24: 11.2 -> 4.6 us at
EP=2, ring).

`--malloc retain` also keeps freed memory in the C library's heap (`hostmem.RETAIN_TUNABLES`:
no `mmap` for large blocks, no trimming, one arena). XLA:CPU allocates each execution's
temporary buffer per simulated device with `malloc` and frees it after, so by default every
call maps it afresh and the kernel clears its pages; that cost follows the worst-case buffers
(larger at EP=8) and is an artifact of simulating devices on one host (a device allocator keeps
its pool). The default (`--malloc default`) is how the `expertax` command runs.

Every case is compiled first; then all are timed together, one call each per round, `--iters`
rounds in alternating order, and each case reports its median call.

`--runs K` runs all of it K times, each in a fresh process, and prints (and writes to `--json`,
with every run's rows) per case the median time across runs and each run's ratio to EP=2 with
their median: on the 2-core VM the same case moves by 10-20 % from one process to the next, far
more than within one, so a ratio from one process is one draw.

`--ffn fused fused-kept separate` times each case with the fused routed FFN
(`moe_fused_routed_ffn`, nn/moe/routed.py, the default; under the config's remat_policy=full its
gate and up are recomputed in the backward loop), the fused FFN keeping gate and up as
residuals (remat_policy=none) and the separate row loops and grouped matmuls, in the same
interleaved rounds; `temp_mib` is each program's temporaries per device (XLA's
`memory_analysis`).

`--checkpoint` runs the layer under `jax.checkpoint` with the config's remat policy (the default
`full`), as a decoder layer trains; without it the layer runs alone (no replay).

Run: python benchmarks/moe_layer.py [--iters 5] [--length 128] [--json PATH] [--routing
balanced] [--ep 1 8] [--ffn fused separate] [--checkpoint] [--runs K] (sets 8 host devices when
on CPU). Prints one JSON
line per case, then a Markdown table; `--json PATH` also writes {"shape": ..., "rows":
[{routing, strategy, routed_ffn, ep, temp_mib, us_per_routed_token, max_load_ratio,
dispatch_bytes, ideal_bytes, allreduce_bytes, sort_share, gather_share, collective_share}]}
(shares null where not profiled).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from expertax import hostmem  # noqa: E402
from expertax.config import config_rules  # noqa: E402
from expertax.nn import param  # noqa: E402
from expertax.nn.moe import ep, layer, router  # noqa: E402
from expertax.parallel import remat  # noqa: E402
from expertax.preflight import load_config  # noqa: E402
from expertax.sharding import make_mesh, use_rules  # noqa: E402
from hlo_profile import DISPATCH_OPS, collective_bytes, profile_shares  # noqa: E402

SHAPE = dict(batch=8, length=128, d=128, f=256, e=16, k=4)
# --ffn variant -> config overrides (the layer runs alone, without jax.checkpoint; the remat
# policy only decides whether the fused path keeps gate and up or recomputes them)
FFN = {
    "fused": {"moe_fused_routed_ffn": True},
    "fused-kept": {"moe_fused_routed_ffn": True, "remat_policy": "none"},
    "separate": {"moe_fused_routed_ffn": False},
}


def make_case(skewed: bool):
    s = SHAPE
    c = load_config(
        overrides={
            "model_name": "mixtral-tiny",
            "base_emb_dim": s["d"],
            "base_moe_mlp_dim": s["f"],
            "num_experts": s["e"],
            "num_experts_per_tok": s["k"],
            "max_target_length": s["length"],
        }
    )
    p = param.initialize(layer.spec(c), jax.random.key(0), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (s["batch"], s["length"], s["d"]))
    if skewed:  # a shared direction u that the first k experts' router columns favour
        u = jnp.zeros((s["d"],)).at[0].set(1.0)
        x = x + 3.0 * u[None, None, :]
        w = p.router.w.at[:, : s["k"]].add(2.0 * u[:, None])
        p = type(p)(
            router=router.Router(w, p.router.bias),
            wi_0=p.wi_0,
            wi_1=p.wi_1,
            wo=p.wo,
            shared=p.shared,
        )
    return c, p, x


# `--checkpoint`: the layer under jax.checkpoint with the config's remat policy, as a decoder
# layer runs in training (`remat.wrap_layer`); otherwise alone.
CHECKPOINT = {"on": False}


def loss(p, x, c):
    def fn(p, x):
        return layer.apply(p, x, c, jnp.float32)[:2]

    if CHECKPOINT["on"]:
        fn = remat.wrap_layer(fn, c, prevent_cse=True)
    y, st = fn(p, x)
    return jnp.sum(y * y), st.load_E


def compile_case(c, p, x, mesh, profile_iters=0):
    """(call() -> blocks, collective bytes, max/mean expert load, profile shares, temporary
    bytes per device)."""
    # Gradients for the weights and the input, as inside a model (the input's gradient needs
    # the transposed forward all-to-all / all-gather).
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    if mesh is None:
        compiled = f.lower(p, x, c).compile()
    else:
        with jax.set_mesh(mesh), use_rules(config_rules(c)):
            p = jax.device_put(p, param.shardings(layer.spec(c), mesh, config_rules(c)))
            compiled = f.lower(p, x, c).compile()
    args = (p, x)
    out = jax.block_until_ready(compiled(*args))
    load = np.asarray(out[0][1])
    shares = profile_shares(compiled, args, profile_iters) if profile_iters else {}

    def call():
        jax.block_until_ready(compiled(*args))

    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    return call, collective_bytes(compiled.as_text()), float(load.max() / load.mean()), shares, temp


def median_call_s(calls: list, iters: int) -> list[float]:
    """Median seconds per call of each of `calls`, timed in `iters` interleaved rounds (order
    reversed every other round) so that the machine's drift falls on all of them alike."""
    times: list[list[float]] = [[] for _ in calls]
    for r in range(iters):
        order = range(len(calls)) if r % 2 == 0 else reversed(range(len(calls)))
        for i in order:
            t0 = time.perf_counter()
            calls[i]()
            times[i].append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in times]


def ideal_bytes(strategy: str, epn: int) -> int:
    s = SHAPE
    n_local = s["batch"] * s["length"] // 8
    if epn == 1:
        return 0
    if strategy == "a2a":
        return 2 * 2 * s["k"] * s["d"] * 4 * n_local  # out and back, forward and backward
    return 2 * 2 * (epn - 1) * n_local * s["d"] * 4  # all-gather + reduce-scatter, fwd and bwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5, help="timed rounds (median per case)")
    ap.add_argument("--length", type=int, default=SHAPE["length"], help="tokens per sequence")
    ap.add_argument("--json", help="also write the rows (and profile shares) to this file")
    ap.add_argument("--routing", nargs="+", default=["balanced", "skewed"])
    ap.add_argument("--ep", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--strategy", nargs="+", default=["a2a", "ring"])
    ap.add_argument(
        "--ffn",
        nargs="+",
        choices=tuple(FFN),
        default=["fused"],
        help="fused: moe_fused_routed_ffn (the default; with the config's remat_policy=full its "
        "gate and up are recomputed per tile in the backward loop); fused-kept: the same with "
        "gate and up kept as [M, F] residuals (remat_policy=none); separate: "
        "moe_fused_routed_ffn=false. Several: an A/B in one interleaved run",
    )
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument(
        "--checkpoint",
        action="store_true",
        help="run the layer under jax.checkpoint with the config's remat policy (full; "
        "fused-kept: none, so unwrapped), as a decoder layer trains: the backward pass replays "
        "what it needs of the forward",
    )
    ap.add_argument("--hugepages", choices=("on", "off"), default="on")
    ap.add_argument("--malloc", choices=("default", "retain"), default="default")
    ap.add_argument(
        "--runs",
        type=int,
        default=1,
        help="run the whole benchmark this many times, each in a fresh process, and summarise "
        "the medians across runs and each run's ratio to EP=2 (the process-to-process spread "
        "on the 2-core VM is larger than the spread within one process)",
    )
    args = ap.parse_args()
    if args.runs > 1:
        return repeated_runs(args)
    hostmem.reexec_with_hugepages(
        [sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
        on=args.hugepages == "on",
        retain=args.malloc == "retain",
    )
    SHAPE["length"] = args.length
    CHECKPOINT["on"] = args.checkpoint
    impl = ep.resolve_a2a_impl(load_config(overrides={"model_name": "mixtral-tiny"}))
    routed = SHAPE["batch"] * SHAPE["length"] * SHAPE["k"]
    rows, calls = [], []
    for skewed in [r == "skewed" for r in args.routing]:
        c0, p, x = make_case(skewed)
        for ffn in args.ffn:
            c1 = c0.model_copy(update=FFN[ffn])
            call, _, ratio, _, temp = compile_case(c1, p, x, None)
            calls.append(call)
            rows.append(
                dict(
                    routing="skewed" if skewed else "balanced",
                    strategy="no mesh",
                    routed_ffn=ffn,
                    ep=1,
                    temp_mib=temp / 2**20,
                    max_load_ratio=ratio,
                    dispatch_bytes=0,
                    ideal_bytes=0,
                    allreduce_bytes=0,
                    sort_share=None,
                    gather_share=None,
                    collective_share=None,
                )
            )
        for epn, strategy, ffn in itertools.product(args.ep, args.strategy, args.ffn):
            c = c0.model_copy(
                update={
                    "ici_expert_parallelism": epn,
                    "ici_data_parallelism": 8 // epn,
                    "ici_fsdp_parallelism": 1,
                    "use_ring_of_experts": strategy == "ring",
                    **FFN[ffn],
                }
            )
            prof = args.profile and not skewed and epn in (1, 8)
            call, coll, ratio, shares, temp = compile_case(
                c, p, x, make_mesh(c), args.iters if prof else 0
            )
            calls.append(call)
            rows.append(
                dict(
                    routing="skewed" if skewed else "balanced",
                    strategy=strategy if strategy == "ring" else f"a2a-{impl}",
                    routed_ffn=ffn,
                    ep=epn,
                    temp_mib=temp / 2**20,
                    max_load_ratio=ratio,
                    dispatch_bytes=sum(coll.get(k, 0) for k in DISPATCH_OPS),
                    ideal_bytes=ideal_bytes(strategy, epn),
                    allreduce_bytes=coll.get("all-reduce", 0),
                    sort_share=shares.get("sort_share"),
                    gather_share=shares.get("gather_share"),
                    collective_share=shares.get("collective_share"),
                )
            )
    for row, seconds in zip(rows, median_call_s(calls, args.iters), strict=True):
        row["us_per_routed_token"] = seconds / routed * 1e6
        print(json.dumps(row), flush=True)
    print(
        f"\nshape {SHAPE}, float32, fwd+bwd of one MoE layer; bytes per device per layer; "
        f"huge pages {hostmem.hugepages_active()}, malloc retains {hostmem.retain_active()}, "
        f"under jax.checkpoint {args.checkpoint}"
    )
    print(
        "| routing | strategy | routed FFN | EP | us / routed token | temp MiB | max load / mean "
        "| dispatch bytes (HLO) | ideal bytes | ratio | all-reduce bytes | sort | gather "
        "| collectives |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["dispatch_bytes"] / r["ideal_bytes"] if r["ideal_bytes"] else float("nan")
        print(
            f"| {r['routing']} | {r['strategy']} | {r['routed_ffn']} | {r['ep']} "
            f"| {r['us_per_routed_token']:.3f} | {r['temp_mib']:.1f} | {r['max_load_ratio']:.2f} "
            f"| {r['dispatch_bytes']:,} | {r['ideal_bytes']:,} "
            f"| {ratio:.2f} | {r['allreduce_bytes']:,} | {_pct(r['sort_share'])} "
            f"| {_pct(r['gather_share'])} | {_pct(r['collective_share'])} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "shape": SHAPE,
                    "hugepages": hostmem.hugepages_active(),
                    "malloc_retain": hostmem.retain_active(),
                    "checkpoint": args.checkpoint,
                    "rows": rows,
                },
                f,
                indent=1,
            )


def _child_argv(argv: list[str]) -> list[str]:
    """`argv` without `--runs` and `--json` (and their values)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--runs", "--json"):
            skip = True
        elif not a.startswith(("--runs=", "--json=")):
            out.append(a)
    return out


def summarise_runs(runs: list[list[dict]]) -> list[dict]:
    """Per case (routing, strategy, routed FFN, EP): the median, min and max of
    us_per_routed_token over runs, and, where the run has EP=2, each run's ratio to it (both
    from the same process) with its median."""
    keys = ("routing", "strategy", "routed_ffn", "ep")
    cases: dict[tuple, list[float]] = {}
    ratios: dict[tuple, list[float]] = {}
    for rows in runs:
        at = {tuple(r[k] for k in keys): r["us_per_routed_token"] for r in rows}
        for key, us in at.items():
            cases.setdefault(key, []).append(us)
            base = at.get((*key[:3], 2))
            if base and key[3] != 2 and key[1] != "no mesh":
                ratios.setdefault(key, []).append(us / base)
    return [
        dict(
            zip(keys, key, strict=True),
            us_median=float(np.median(us)),
            us_min=min(us),
            us_max=max(us),
            ratio_to_ep2=ratios.get(key),
            ratio_to_ep2_median=float(np.median(ratios[key])) if key in ratios else None,
        )
        for key, us in cases.items()
    ]


def repeated_runs(args) -> None:
    """`--runs K`: K fresh processes of this script, then the summary (`summarise_runs`)."""
    import subprocess
    import tempfile

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.runs):
            path = os.path.join(tmp, f"run{k}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *_child_argv(sys.argv[1:])]
            subprocess.run([*cmd, "--json", path], check=True)
            with open(path) as f:
                runs.append(json.load(f))
    summary = summarise_runs([r["rows"] for r in runs])
    print(
        f"\n{args.runs} runs, each in a fresh process; ratio: us at this EP / us at EP=2 of "
        "the same run"
    )
    print(
        "| routing | strategy | routed FFN | EP | us / routed token, median (min-max) "
        "| ratio to EP=2 per run | median ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in summary:
        per_run = ", ".join(f"{x:.2f}" for x in r["ratio_to_ep2"] or []) or "-"
        med = "-" if r["ratio_to_ep2_median"] is None else f"{r['ratio_to_ep2_median']:.3f}"
        print(
            f"| {r['routing']} | {r['strategy']} | {r['routed_ffn']} | {r['ep']} "
            f"| {r['us_median']:.3f} ({r['us_min']:.3f}-{r['us_max']:.3f}) | {per_run} | {med} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": runs[0]["shape"], "runs": runs, "summary": summary}, f, indent=1)


def _pct(share) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


if __name__ == "__main__":
    main()
