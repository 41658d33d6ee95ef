"""One train step (forward + backward + AdamW), expertax against torch + transformers, on CPU.

The question a user choosing a trainer asks: on the same CPU, same model dims, same token batch,
float32, AdamW with the same settings, how long does a step take? Both sides run in this one
process, one after the other, with the same thread count (torch.set_num_threads = cores; XLA:CPU
uses every core by default), on one CPU device. expertax keeps every activation with
remat_policy=none, as torch does; `--remat full` is for information.

Models (D, layers, heads / kv heads of 64, vocab, MLP from the issue; --dims picks the sizes):
- llama: LlamaForCausalLM against model_name=llama-tiny, dense SwiGLU MLP.
- mixtral: MixtralForCausalLM against model_name=mixtral-tiny, 8 experts, top-2 softmax routing.

`--profile` traces a few expertax steps (jax.profiler) and prints the step's top XLA ops (mostly
fusions) with their total time per step and the jax source ops they were fused from (the HLO
metadata op_name of the fusion's instructions).

The run also measures float32 matmul GFLOP/s of both libraries at the models' two main shapes
(tokens x D x MLP and tokens x D x vocab, `matmul_gflops` in every JSON line): the ratio leans on
the host's matmul libraries (on the 2026-11-24 Zen 5 host XLA:CPU's ran at about 2 x torch's).

The two steps are timed in turns (`interleaved`), so that a slow spell of a shared machine falls
on both. `--hugepages on` (the default) re-executes the script with glibc's malloc on transparent
huge pages, as the `expertax` command runs (expertax.hostmem); torch then runs with them too.

Run: python benchmarks/step_vs_torch.py [--dims mid|small] [--models llama,mixtral]
     [--remat none|full] [--iters 10] [--hugepages on|off] [--profile] [--json PATH]
     [--set key=value ...]
Prints one JSON line per model and a Markdown table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from expertax import hostmem
from expertax.preflight import load_config
from expertax.train.trainer import build_trainer

DIMS = {
    # D, layers, query heads, kv heads, head dim, vocab, T, batch, dense MLP, expert MLP
    "mid": dict(d=512, layers=4, heads=8, kv=4, hd=64, vocab=8192, t=512, batch=2, mlp=1536),
    "small": dict(d=256, layers=4, heads=4, kv=2, hd=64, vocab=8192, t=256, batch=4, mlp=1024),
}
EXPERTS, TOPK, LR, B1, B2, EPS, WD, CLIP = 8, 2, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0


def expert_mlp(dims: dict) -> int:
    return dims["mlp"] // 2  # mid: 8 experts of 768


def expertax_config(model: str, dims: dict, remat: str, extra: dict):
    common = dict(
        base_emb_dim=dims["d"],
        base_num_decoder_layers=dims["layers"],
        base_num_query_heads=dims["heads"],
        base_num_kv_heads=dims["kv"],
        head_dim=dims["hd"],
        vocab_size=dims["vocab"],
        max_target_length=dims["t"],
        per_device_batch_size=dims["batch"],
        remat_policy=remat,
        dtype="float32",
        weight_dtype="float32",
        learning_rate=LR,
        adam_b1=B1,
        adam_b2=B2,
        adam_eps=EPS,
        adam_weight_decay=WD,
        gradient_clipping_threshold=CLIP,
        steps=1000,
    )
    if model == "llama":
        over = dict(model_name="llama-tiny", base_mlp_dim=dims["mlp"])
    else:
        over = dict(
            model_name="mixtral-tiny",
            base_moe_mlp_dim=expert_mlp(dims),
            num_experts=EXPERTS,
            num_experts_per_tok=TOPK,
        )
    return load_config(overrides={**common, **over, **extra})


def synthetic_batch(dims: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    b, t = dims["batch"], dims["t"]
    tokens = rng.integers(0, dims["vocab"], size=(b, t + 1), dtype=np.int32)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": np.ones((b, t), np.int32),
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "weights": np.ones((b, t), np.float32),
    }


def _block(tree):
    jax.block_until_ready(tree)


def prepare_expertax(model, dims, remat, extra, warmup, stack: contextlib.ExitStack):
    """Compile and warm up expertax's step inside the trainer's context (entered on `stack`);
    returns (step() -> loss, compile seconds, profile(dir, n) -> top ops)."""
    c = expertax_config(model, dims, remat, extra)
    tr = build_trainer(c, devices=jax.devices()[:1])
    stack.enter_context(tr.context())
    holder = {"state": tr.init_state()}
    batch = tr.put_batch(synthetic_batch(dims))
    t0 = time.perf_counter()
    compiled = tr.jitted_step().lower(holder["state"], batch).compile()
    compile_s = time.perf_counter() - t0

    def step():
        holder["state"], metrics = compiled(holder["state"], batch)
        _block((holder["state"], metrics))
        return float(metrics["loss"])

    for _ in range(warmup):
        step()

    def profile(profile_dir: str, n: int = 3) -> list[dict]:
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            for _ in range(n):
                step()
        return top_ops(profile_dir, compiled.as_text(), n)

    return step, compile_s, profile


def _hlo_sources(hlo_text: str) -> dict[str, list[str]]:
    """Fusion/computation name -> the distinct jax op_names of its instructions (HLO metadata)."""
    # Each fused computation's body lists its instructions with metadata; the fusion
    # instruction names its computation in calls=%fused_computation...
    comp_ops: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$", line)
        if m:
            current = m.group(1)
            comp_ops.setdefault(current, [])
            continue
        if current is None:
            continue
        for op in re.findall(r'op_name="([^"]+)"', line):
            short = _short_op(op)
            if short not in comp_ops[current]:
                comp_ops[current].append(short)
    # every instruction (copies and other ops without metadata too), with its sources if any
    out: dict[str, list[str]] = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*calls=%?([\w.\-]+)", line)
        if m:
            out[m.group(1)] = comp_ops.get(m.group(2), [])
            continue
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if m and m.group(1) not in out:
            op = re.search(r'op_name="([^"]+)"', line)
            out[m.group(1)] = [_short_op(op.group(1))] if op else []
    return out


def _short_op(op_name: str) -> str:
    # jit(train_step)/jvp(...)/transpose(jvp(silu))/mul -> keep the last three path parts
    parts = op_name.split("/")
    return "/".join(parts[-3:])


def top_ops(profile_dir: str, hlo_text: str, steps: int, k: int = 10) -> list[dict]:
    """The k XLA ops with the most time per step in the trace, with their jax source ops."""
    files = glob.glob(os.path.join(profile_dir, "**", "*.trace.json.gz"), recursive=True)
    files += glob.glob(os.path.join(profile_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        return []
    with gzip.open(sorted(files, key=os.path.getmtime)[-1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    sources = _hlo_sources(hlo_text)
    total: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        name = e.get("name", "")
        # a while/call/conditional's span contains its body's ops: count the ops only
        if name in sources and not name.startswith(("while", "call", "conditional")):
            total[name] += e["dur"] / 1e3
    rows = []
    step_ms = sum(total.values()) / steps
    for name, ms in total.most_common(k):
        rows.append(dict(op=name, ms=round(ms / steps, 2), sources=sources.get(name, [])[:4]))
    return [dict(op="(all traced XLA ops)", ms=round(step_ms, 1), sources=[]), *rows]


def torch_model(model: str, dims: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(
        vocab_size=dims["vocab"],
        hidden_size=dims["d"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv"],
        head_dim=dims["hd"],
        max_position_embeddings=dims["t"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    if model == "llama":
        return LlamaForCausalLM(LlamaConfig(intermediate_size=dims["mlp"], **common))
    cfg = MixtralConfig(
        intermediate_size=expert_mlp(dims),
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        router_aux_loss_coef=0.0,
        **common,
    )
    return MixtralForCausalLM(cfg)


def prepare_torch(model, dims, warmup):
    """The torch + transformers step, warmed up: returns step() -> loss."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    m = torch_model(model, dims).float().train()
    decay = [p for p in m.parameters() if p.ndim >= 2]
    no_decay = [p for p in m.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [dict(params=decay, weight_decay=WD), dict(params=no_decay, weight_decay=0.0)],
        lr=LR,
        betas=(B1, B2),
        eps=EPS,
    )
    b = synthetic_batch(dims)
    inputs = torch.from_numpy(b["inputs"]).long()
    targets = torch.from_numpy(b["targets"]).long()

    def step():
        opt.zero_grad(set_to_none=True)
        logits = m(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
        return loss.item()

    for _ in range(warmup):
        step()
    return step


def interleaved(steps: dict, iters: int, block: int = 2) -> dict:
    """Time the named steps in turns: rounds of `block` timed steps of each, after one untimed
    step that re-warms it (the other's step in between leaves the allocator and caches cold: on
    the 2-core host an expertax step right after a torch step measured up to 1.8x slower with
    huge pages on), the order flipped every round. A slow spell of a shared machine then falls
    on both sides. Returns name -> (`iters` times in ms, last loss)."""
    times: dict = {k: [] for k in steps}
    loss: dict = {}
    names = list(steps)
    for r in range(-(-iters // block)):
        for name in names if r % 2 == 0 else names[::-1]:
            steps[name]()
            for _ in range(min(block, iters - r * block)):
                t0 = time.perf_counter()
                loss[name] = steps[name]()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: (times[k], loss[k]) for k in steps}


def matmul_gflops(dims: dict, with_torch: bool, calls: int = 30) -> dict:
    """Median float32 GFLOP/s of `a @ b` in jax and torch (same threads as the steps) at the
    models' projection and head shapes (`dims`): {"MxKxN": {"jax": .., "torch": ..}}."""
    m, k = dims["batch"] * dims["t"], dims["d"]
    out = {}
    for n in (dims["mlp"], dims["vocab"]):
        flop = 2 * m * k * n
        a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
        rates = {"jax": _rate(_jax_matmul, (a, b), flop, calls)}
        if with_torch:
            import torch

            torch.set_num_threads(os.cpu_count() or 1)  # as prepare_torch
            ta, tb = torch.ones(m, k), torch.ones(k, n)
            rates["torch"] = _rate(torch.matmul, (ta, tb), flop, calls)
        out[f"{m}x{k}x{n}"] = rates
    return out


_jax_matmul = jax.jit(jnp.matmul)


def _rate(fn, operands: tuple, flop: int, calls: int) -> float:
    """Median GFLOP/s of `fn(*operands)` (a jax result is waited for)."""
    times = []
    for i in range(calls + 1):
        t0 = time.perf_counter()
        out = fn(*operands)
        if hasattr(out, "block_until_ready"):
            out.block_until_ready()
        if i:  # the first call compiles / warms up
            times.append(time.perf_counter() - t0)
    return round(flop / statistics.median(times) / 1e9, 1)


def _parse_sets(sets: list[str]) -> dict:
    out = {}
    for s in sets:
        k, v = s.split("=", 1)
        out[k] = {"true": True, "false": False}.get(v.lower(), v)
        try:
            out[k] = int(v)
        except ValueError:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dims", choices=sorted(DIMS), default="mid")
    ap.add_argument("--models", default="llama,mixtral")
    ap.add_argument("--remat", default="none")
    ap.add_argument("--iters", type=int, default=10, help="timed steps of each, interleaved")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="top XLA ops of the expertax step")
    ap.add_argument("--no-torch", action="store_true", help="time expertax only")
    ap.add_argument("--json", help="also append the JSON lines to this file")
    ap.add_argument(
        "--set", action="append", default=[], help="extra expertax config key=value (repeatable)"
    )
    ap.add_argument(
        "--hugepages",
        choices=("on", "off"),
        default="on",
        help="run both sides with glibc's malloc on transparent huge pages (expertax.hostmem;\n"
        "on: as the expertax command runs) or without (the C library's default)",
    )
    args = ap.parse_args()
    hostmem.reexec_with_hugepages(
        [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], on=args.hugepages == "on"
    )
    dims = DIMS[args.dims]
    extra = _parse_sets(args.set)
    rows = []
    matmul = matmul_gflops(dims, with_torch=not args.no_torch)
    for model in args.models.split(","):
        stack = contextlib.ExitStack()
        ex_step, compile_s, profile = prepare_expertax(
            model, dims, args.remat, extra, args.warmup, stack
        )
        steps = {"expertax": ex_step}
        if not args.no_torch:
            steps["torch"] = prepare_torch(model, dims, args.warmup)
        timed = interleaved(steps, args.iters)
        ex_times, ex_loss = timed["expertax"]
        ex_ms = statistics.median(ex_times)
        rec = dict(
            model=model,
            dims=args.dims,
            remat=args.remat,
            set=extra,
            cores=os.cpu_count(),
            hugepages=hostmem.hugepages_active(),
            load_average=round(os.getloadavg()[0], 2),
            expertax_ms=round(ex_ms, 1),
            expertax_times=[round(t, 1) for t in ex_times],
            expertax_compile_s=round(compile_s, 2),
            expertax_loss=round(ex_loss, 4),
            matmul_gflops=matmul,
        )
        if "torch" in timed:
            import torch

            tc_times, tc_loss = timed["torch"]
            tc_ms = statistics.median(tc_times)
            rec.update(
                torch_ms=round(tc_ms, 1),
                torch_times=[round(t, 1) for t in tc_times],
                torch_loss=round(tc_loss, 4),
                torch_threads=torch.get_num_threads(),
                ratio=round(ex_ms / tc_ms, 2),
            )
        if args.profile:
            with tempfile.TemporaryDirectory() as prof:
                rec["profile"] = profile(prof)
        stack.close()
        line = json.dumps(rec)
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")
        rows.append(rec)
    pages = "huge pages" if hostmem.hugepages_active() else "default pages"
    head = f"model ({args.dims}, remat={args.remat}, {pages})"
    print(f"\n| {head} | expertax ms | torch ms | ratio | compile s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['expertax_ms']} | {r.get('torch_ms', '-')} | "
            f"{r.get('ratio', '-')} | {r['expertax_compile_s']} |"
        )
    print("\nfloat32 matmul GFLOP/s (median of 30 calls):")
    for shape, rates in matmul.items():
        print(f"  {shape}: " + ", ".join(f"{k} {v}" for k, v in rates.items()))
    for r in rows:
        if "profile" in r:
            print(f"\nexpertax {r['model']}: top XLA ops, ms per step")
            for p in r["profile"]:
                print(f"  {p['ms']:8.2f}  {p['op']:<40} {'; '.join(p['sources'])}")


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before torch takes its threads
    main()
