"""Decode throughput: `expertax.decoding.generate` against transformers' `generate`, on CPU.

The same random weights on both sides: expertax parameters drawn from each parameter's declared
initializer (numpy), written for transformers with `expertax.convert.write_hf` and loaded with
`AutoModelForCausalLM.from_pretrained` (its default attention, dynamic cache). Greedy decoding,
`--batches` rows of `--prompt-length` random tokens each (one length, no padding), exactly
`--new-tokens` new tokens (no EOS stop on either side). expertax runs on one device; torch uses
as many threads as there are cores (XLA:CPU uses every core by default).

Each call is timed at `max_new_tokens=1` (prefill and the first token) and `--new-tokens`
(prefill and the decode loop), after one warm-up call of each shape (compilation excluded);
decode tokens/s = batch x (new tokens - 1) / (median time at N - median time at 1); prefill_s is
the whole call at max_new_tokens=1, host-side work included. `same_tokens`: the share of new
tokens identical on both sides (float32: 1, or a near-tie away from it; bfloat16 rounds
differently in the two libraries). The calls of the two libraries alternate (`--repeats` rounds,
the order reversed every other round), so that a slow spell of a shared machine falls on both.
The target: expertax decode tokens/s >= 2 x transformers'. `expertax-xla` is expertax with XLA's
products in place of our CPU kernel (decoding/rowdot.py, `EXPERTAX_ROWDOT=0`), in the same run
(`--no-xla` skips it).

`--speculative` adds expertax with one MTP module (mtp_num_layers=1, the same main weights):
greedy speculative decoding against plain greedy decoding of that model. The weights are random,
so the MTP module's drafts are almost never accepted (acceptance ~ 0) and each step then pays for
a two-token main step and the MTP block while keeping one token: the figure shows the overhead,
not the speed-up of a trained model.

The KV-cache bytes per token of each model (`expertax.decoding.bytes_per_token`, MLA
compressed and plain) are printed too, and DeepSeek-V3 671B's from its config alone.

Run: PYTHONPATH=src python benchmarks/generate.py [--models deepseek3-small,mixtral-tiny]
     [--batches 1 8] [--dtypes bfloat16 float32] [--prompt-length 64] [--new-tokens 64]
     [--repeats 3] [--speculative] [--no-xla] [--hugepages on|off] [--json PATH]
Prints JSON lines (the first one the host's), then Markdown tables; `--json` appends the lines
to a file as they come (benchmarks/results/generate/<date>.jsonl for BENCHMARKS.md). Measure
alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from expertax import hostmem
from expertax.convert import write_hf
from expertax.decoding import bytes_per_token, generate, prepare, rowdot
from expertax.models import decoder
from expertax.nn.param import is_spec
from expertax.preflight import load_config

NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def model_config(name: str, dtype: str, length: int, mtp: bool):
    """The preset with compute and weights in `dtype`, room for `length` positions."""
    return load_config(
        overrides={
            "model_name": name,
            "dtype": dtype,
            "weight_dtype": dtype,
            "max_target_length": length,
            "mtp_num_layers": 1 if mtp else 0,
        }
    )


def random_params(c, seed: int):
    """Float32 numpy parameters from each spec's initializer (a numpy draw: jax's threefry
    init compiles slowly on CPU); the routing bias stays zero."""
    rng = np.random.default_rng(seed)

    def draw(s):
        if s.init == "normal":
            return rng.standard_normal(s.shape, dtype=np.float32) * np.float32(s.scale)
        return (np.ones if s.init == "ones" else np.zeros)(s.shape, np.float32)

    return jax.tree.map(draw, decoder.spec(c), is_leaf=is_spec)


def cast(params, dtype: str):
    return jax.tree.map(lambda x: np.asarray(x).astype(NUMPY_DTYPES[dtype]), params)


def load_transformers(path: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # decode exactly the budget, as expertax
    model.generation_config.pad_token_id = 0
    return model


@dataclasses.dataclass
class Runner:
    """One side of the comparison: call(prompts, n) -> (seconds, tokens [B, n], acceptance)."""

    name: str
    call: object


def expertax_runner(
    name: str, params, c, *, speculative: bool = False, kernel: bool = True
) -> Runner:
    """`kernel=False`: XLA's products instead of our CPU kernel (decoding/rowdot.py)."""
    device = jax.devices()[0]
    params = prepare(params, c, devices=[device])  # the layers unstacked once, not per call

    def call(prompts: np.ndarray, n: int):
        if kernel:
            os.environ.pop(rowdot.SWITCH, None)
        else:
            os.environ[rowdot.SWITCH] = "0"
        t0 = time.perf_counter()
        out = generate(
            params,
            c,
            prompts.tolist(),
            max_new_tokens=n,
            speculative=speculative,
            devices=[device],
        )
        return time.perf_counter() - t0, np.array(out.tokens), out.acceptance

    return Runner(name, call)


def transformers_runner(model) -> Runner:
    import torch

    @torch.no_grad()
    def call(prompts: np.ndarray, n: int):
        ids = torch.from_numpy(prompts.astype(np.int64))
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
        )
        seconds = time.perf_counter() - t0
        return seconds, out[:, prompts.shape[1] :].numpy(), None

    return Runner("transformers", call)


def measure(runners: list[Runner], prompts: np.ndarray, n: int, repeats: int) -> dict:
    """Per runner: median seconds at 1 and n new tokens, the tokens and acceptance at n."""
    for r in runners:  # warm-up: compile (expertax) and first-call costs, both shapes
        r.call(prompts, 1)
        r.call(prompts, n)
    times: dict = {r.name: {1: [], n: []} for r in runners}
    last: dict = {}
    for i in range(repeats):
        for r in runners if i % 2 == 0 else runners[::-1]:
            times[r.name][1].append(r.call(prompts, 1)[0])
            seconds, tokens, acceptance = r.call(prompts, n)
            times[r.name][n].append(seconds)
            last[r.name] = (tokens, acceptance)
    b = prompts.shape[0]
    out = {}
    for r in runners:
        t1, tn = (statistics.median(times[r.name][k]) for k in (1, n))
        tokens, acceptance = last[r.name]
        assert tokens.shape == (b, n), (r.name, tokens.shape)
        out[r.name] = dict(
            prefill_s=round(t1, 4),
            total_s=round(tn, 4),
            # None where the difference drowns in noise (a tiny model, a short budget)
            decode_tokens_per_s=round(b * (n - 1) / (tn - t1), 1) if tn > t1 else None,
            tokens_per_s=round(b * n / tn, 1),
            times_1=[round(t, 4) for t in times[r.name][1]],
            times_n=[round(t, 4) for t in times[r.name][n]],
            acceptance=acceptance,
            tokens=tokens,
        )
    return out


def run_model(name: str, dtype: str, args, hf_path: Path, params_f32) -> list[dict]:
    """The records of one model in one dtype, one per batch size."""
    length = args.prompt_length + args.new_tokens + 2  # the speculative loop's 2 extra slots
    c = model_config(name, dtype, length, mtp=False)
    params = cast(params_f32, dtype)
    plain = dataclasses.replace(params, mtp=None)
    runners = [expertax_runner("expertax", plain, c)]
    if not args.no_xla:
        runners.append(expertax_runner("expertax-xla", plain, c, kernel=False))
    if not args.no_torch:
        runners.append(transformers_runner(load_transformers(hf_path, dtype)))
    if args.speculative:
        c_mtp = model_config(name, dtype, length, mtp=True)
        runners += [
            expertax_runner("expertax-mtp-greedy", params, c_mtp),
            expertax_runner("expertax-mtp-speculative", params, c_mtp, speculative=True),
        ]
    records = []
    for b in args.batches:
        rng = np.random.default_rng(b)
        prompts = rng.integers(0, c.vocab_size, (b, args.prompt_length), dtype=np.int32)
        res = measure(runners, prompts, args.new_tokens, args.repeats)
        ex = res["expertax"]
        rec = dict(
            model=name,
            dtype=dtype,
            batch=b,
            prompt_length=args.prompt_length,
            new_tokens=args.new_tokens,
            load_average=[round(x, 2) for x in os.getloadavg()],
            kv_bytes_per_token={f: bytes_per_token(c, f) for f in ("compressed", "plain")},
        )
        for key, r in res.items():
            rec[key] = {k: v for k, v in r.items() if k != "tokens"}
        if "transformers" in res:
            hf = res["transformers"]
            if ex["decode_tokens_per_s"] and hf["decode_tokens_per_s"]:
                ratio = ex["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
                rec["decode_ratio"] = round(ratio, 2)
            rec["same_tokens"] = round(float(np.mean(ex["tokens"] == hf["tokens"])), 3)
        records.append(rec)
        emit(rec, args.json)
    return records


def emit(rec: dict, path: str | None) -> None:
    """Print a JSON line, and append it to `path` (as it comes: a killed run keeps its lines)."""
    line = json.dumps(rec)
    print(line, flush=True)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(line + "\n")


def kv_table(models: list[str], dtypes: list[str]) -> list[str]:
    lines = [
        "| model | dtype | layers | compressed B/token | plain B/token |",
        "|---|---|---:|---:|---:|",
    ]
    rows = [(m, d) for m in models for d in dtypes] + [("deepseek3-671b", "bfloat16")]
    for m, d in rows:
        c = load_config(overrides={"model_name": m, "dtype": d})
        comp, plain = (bytes_per_token(c, f) for f in ("compressed", "plain"))
        lines.append(f"| {m} | {d} | {c.base_num_decoder_layers} | {comp:,} | {plain:,} |")
    return lines


def table(records: list[dict]) -> list[str]:
    lines = [
        "| model | dtype | batch | expertax decode tok/s | expertax, XLA's products | "
        "transformers decode tok/s | ratio | "
        "expertax prefill s | transformers prefill s | same tokens | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        ex, hf = r["expertax"], r.get("transformers", {})
        xla = r.get("expertax-xla", {})
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['batch']} | {ex['decode_tokens_per_s']} | "
            f"{xla.get('decode_tokens_per_s', '-')} | "
            f"{hf.get('decode_tokens_per_s', '-')} | {r.get('decode_ratio', '-')} | "
            f"{ex['prefill_s']} | {hf.get('prefill_s', '-')} | {r.get('same_tokens', '-')} | "
            f"{r['load_average'][0]} |"
        )
    spec = [r for r in records if "expertax-mtp-speculative" in r]
    if spec:
        lines += [
            "",
            "| model | dtype | batch | greedy decode tok/s | speculative decode tok/s | "
            "acceptance |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in spec:
            g, s = r["expertax-mtp-greedy"], r["expertax-mtp-speculative"]
            lines.append(
                f"| {r['model']} | {r['dtype']} | {r['batch']} | {g['decode_tokens_per_s']} | "
                f"{s['decode_tokens_per_s']} | {s['acceptance']:.3f} |"
            )
    return lines


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="deepseek3-small,mixtral-tiny")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--prompt-length", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds, interleaved")
    ap.add_argument("--speculative", action="store_true", help="also MTP speculative decoding")
    ap.add_argument("--no-torch", action="store_true", help="time expertax only")
    ap.add_argument(
        "--no-xla", action="store_true", help="skip expertax with XLA's products (no CPU kernel)"
    )
    ap.add_argument("--hugepages", choices=("on", "off"), default="on")
    ap.add_argument("--json", help="also append the JSON lines to this file")
    args = ap.parse_args()
    hostmem.reexec_with_hugepages(
        [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], on=args.hugepages == "on"
    )
    versions = {"jax": jax.__version__}
    if not args.no_torch:
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count() or 1)
        transformers.utils.logging.disable_progress_bar()
        versions.update(torch=torch.__version__, transformers=transformers.__version__)
    host = {
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "jax_devices": str(jax.devices()),
        "huge_pages": hostmem.hugepages_active(),
        **versions,
    }
    emit(host, args.json)
    models = args.models.split(",")
    records = []
    for name in models:
        # One float32 draw per model (with the MTP module when --speculative), written once for
        # transformers, which casts it to the dtype it loads in (as `cast` does for expertax).
        length = args.prompt_length + args.new_tokens + 2
        params = random_params(model_config(name, "float32", length, args.speculative), 0)
        with tempfile.TemporaryDirectory() as tmp:
            if not args.no_torch:
                plain = model_config(name, "float32", length, mtp=False)
                write_hf(dataclasses.replace(params, mtp=None), plain, tmp)
            for dtype in args.dtypes:
                records += run_model(name, dtype, args, Path(tmp), params)
    print(f"load average after: {os.getloadavg()}")
    print("\nKV cache bytes per token (all layers):")
    print("\n".join(kv_table(models, args.dtypes)))
    print()
    print("\n".join(table(records)))


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before torch takes its threads
    main()
