"""`expertax convert` speed and memory on synthetic bfloat16 HF Mixtral checkpoints (issue 16).

    python benchmarks/convert.py --gib 1 [3 10] [--dir /tmp/convert-bench] [--keep]

Per size: builds a Mixtral-shaped checkpoint (hidden 2048, 8 experts of 5632, ~500 MB shards,
layers added until the size is reached), runs `from-hf` then `to-hf` each in a fresh
subprocess that samples its own memory every 10 ms, and prints one JSON line per run and a
table: wall s, GiB/s, peak RSS (VmHWM: includes the page cache pages of mmapped safetensors,
which are the files' and reclaimable) and peak anonymous memory (RssAnon: the process's own),
plus DeepSeek-V3 extrapolated from the measured from-hf rate (fp8 hub in: 0.67 TiB read,
1.25 TiB bfloat16 written; the rate per written byte assumed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

HIDDEN, FFN, EXPERTS, VOCAB, HEADS, KV_HEADS = 2048, 5632, 8, 32000, 16, 4

# Runs one conversion in this process while a thread samples /proc/self/status.
_CHILD = r"""
import json, sys, threading, time
peak = {"VmHWM": 0, "RssAnon": 0}
def sample():
    while True:
        for line in open("/proc/self/status"):
            k, _, v = line.partition(":")
            if k in peak:
                peak[k] = max(peak[k], int(v.split()[0]) * 1024)
        time.sleep(0.01)
threading.Thread(target=sample, daemon=True).start()
from expertax.convert import convert_from_hf, convert_to_hf
direction, src, dst = sys.argv[1:4]
t = time.perf_counter()
s = (convert_from_hf if direction == "from-hf" else convert_to_hf)(src, dst)
wall = time.perf_counter() - t
time.sleep(0.03)
print(json.dumps({"wall_s": wall, "gib": s.gib, "tensors": s.tensors,
                  "peak_rss_bytes": peak["VmHWM"], "peak_anon_bytes": peak["RssAnon"]}))
"""


def hf_config(layers: int) -> dict:
    return {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": 2,
        "rope_theta": 1e6,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


def layer_tensors(i: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    hd = HIDDEN // HEADS
    out = {
        p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        p + "self_attn.k_proj.weight": (KV_HEADS * hd, HIDDEN),
        p + "self_attn.v_proj.weight": (KV_HEADS * hd, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        p + "input_layernorm.weight": (HIDDEN,),
        p + "post_attention_layernorm.weight": (HIDDEN,),
        p + "block_sparse_moe.gate.weight": (EXPERTS, HIDDEN),
    }
    for j in range(EXPERTS):
        e = f"{p}block_sparse_moe.experts.{j}."
        out |= {e + "w1.weight": (FFN, HIDDEN), e + "w3.weight": (FFN, HIDDEN)}
        out |= {e + "w2.weight": (HIDDEN, FFN)}
    return out


def make_checkpoint(path: Path, gib: float, shard_bytes: int = 500 * 10**6) -> int:
    """A random bfloat16 Mixtral-shaped checkpoint of about `gib` GiB; returns its bytes."""
    from expertax.convert.safetensors_io import plan_shards, write_file, write_index

    per_layer = sum(int(np.prod(s)) * 2 for s in layer_tensors(0).values())
    fixed = 2 * VOCAB * HIDDEN * 2
    layers = max(1, round((gib * 2**30 - fixed) / per_layer))
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        shapes |= layer_tensors(i)
    shapes |= {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    entries = [(n, s, np.dtype(ml_dtypes.bfloat16)) for n, s in shapes.items()]
    shards = plan_shards(entries, shard_bytes)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pool = rng.standard_normal(2**22).astype(ml_dtypes.bfloat16)  # tiled: fast to produce

    def values(shape):
        n = int(np.prod(shape))
        return np.resize(pool[rng.integers(0, 2**20) :], n).reshape(shape)

    for fname, shard in shards:
        write_file(path / fname, shard, ((n, values(s)) for n, s, _ in shard))
    if len(shards) > 1:
        write_index(path, shards)
    (path / "config.json").write_text(json.dumps(hf_config(layers)))
    return sum(int(np.prod(s)) * 2 for s in shapes.values())


def measure(direction: str, src: Path, dst: Path) -> dict:
    src_root = Path(__file__).resolve().parents[1] / "src"
    env_path = f"{src_root}"
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, direction, str(src), str(dst)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
        check=False,
    )
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/convert-bench"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = ap.parse_args()
    rows = []
    for gib in args.gib:
        base = args.dir / f"{gib:g}gib"
        shutil.rmtree(base, ignore_errors=True)
        t = time.perf_counter()
        nbytes = make_checkpoint(base / "hf", gib)
        print(f"# built {nbytes / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s", flush=True)
        for direction, src, dst in (
            ("from-hf", base / "hf", base / "ours"),
            ("to-hf", base / "ours", base / "back"),
        ):
            m = measure(direction, src, dst)
            row = {"size_gib": nbytes / 2**30, "direction": direction, **m}
            row["gib_per_s"] = nbytes / 2**30 / m["wall_s"]
            print(json.dumps(row), flush=True)
            rows.append(row)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print("\n| size GiB | direction | wall s | GiB/s | peak RSS GiB | peak anon GiB |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['size_gib']:.2f} | {r['direction']} | {r['wall_s']:.1f} | {r['gib_per_s']:.2f} "
            f"| {r['peak_rss_bytes'] / 2**30:.2f} | {r['peak_anon_bytes'] / 2**30:.2f} |"
        )
    rate = [r["gib_per_s"] for r in rows if r["direction"] == "from-hf"]
    if rate:
        ds_out_gib = 671e9 * 2 / 2**30
        hours = ds_out_gib / min(rate) / 3600
        print(
            f"\nDeepSeek-V3 (671B, fp8 hub in, bfloat16 out: {ds_out_gib:.0f} GiB written) at "
            f"{min(rate):.2f} GiB/s: about {hours:.1f} h (float32 out: {2 * hours:.1f} h)"
        )


if __name__ == "__main__":
    main()
