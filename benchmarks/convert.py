"""`expertax convert` speed and memory on synthetic HF checkpoints (issue 16).

    python benchmarks/convert.py --sizes 1,3,10 [--fp8-gib 1] [--dir /tmp/convert-bench] [--keep]

Per size in `--sizes` (GiB): a bfloat16 Mixtral-shaped checkpoint (hidden 2048, experts of 5632,
~500 MB shards) whose layer and expert counts are chosen to come within ~3% of the size; then
`from-hf` and `to-hf`, each in a fresh subprocess that samples its own memory every 10 ms.
`--fp8-gib`: a DeepSeek-V3-shaped fp8 checkpoint (the hub's per-layer shapes and fp8 block
format, fewer layers, experts and vocabulary) converted from-hf into bfloat16 and into float32
and back to-hf (bfloat16), from which DeepSeek-V3's 671 B parameters are extrapolated at the
measured parameters per second (an estimate: same machine, same per-tensor work).

Prints one JSON line per run and a table: wall s, GiB/s (bytes read / wall), peak RSS (VmHWM)
and peak anonymous memory (RssAnon: the process's own, without file pages).
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

HIDDEN, FFN, VOCAB, HEADS, KV_HEADS = 2048, 5632, 32000, 16, 4

# Runs one conversion in this process while a thread samples /proc/self/status.
_CHILD = r"""
import json, sys, threading, time
import numpy as np
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
params = sum(int(np.prod(v.shape)) for v in __import__("expertax.train.model_dir",
             fromlist=["x"]).leaf_paths(s.config).values())
wall = time.perf_counter() - t
time.sleep(0.03)
print(json.dumps({"wall_s": wall, "gib": s.gib, "tensors": s.tensors, "params": params,
                  "peak_rss_bytes": peak["VmHWM"], "peak_anon_bytes": peak["RssAnon"]}))
"""


BF16 = np.dtype(ml_dtypes.bfloat16)
DEEPSEEK_V3_PARAMS = 671e9  # the hub's count (the multi-token-prediction layer included)
DEEPSEEK_V3_HUB_GIB = 642  # its fp8 safetensors: e4m3 linears, bfloat16 embeddings and norms


def hf_config(layers: int, experts: int) -> dict:
    return {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_local_experts": experts,
        "num_experts_per_tok": 2,
        "rope_theta": 1e6,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


def layer_tensors(i: int, experts: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    hd = HIDDEN // HEADS
    out = {
        p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        p + "self_attn.k_proj.weight": (KV_HEADS * hd, HIDDEN),
        p + "self_attn.v_proj.weight": (KV_HEADS * hd, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        p + "input_layernorm.weight": (HIDDEN,),
        p + "post_attention_layernorm.weight": (HIDDEN,),
        p + "block_sparse_moe.gate.weight": (experts, HIDDEN),
    }
    for j in range(experts):
        e = f"{p}block_sparse_moe.experts.{j}."
        out |= {e + "w1.weight": (FFN, HIDDEN), e + "w3.weight": (FFN, HIDDEN)}
        out |= {e + "w2.weight": (HIDDEN, FFN)}
    return out


def _nbytes(shapes: dict[str, tuple[int, ...]], itemsize: int = 2) -> int:
    return sum(int(np.prod(s)) * itemsize for s in shapes.values())


def mixtral_shape(gib: float) -> tuple[int, int]:
    """(layers, experts per layer, 2 to 16) whose checkpoint is within 2% of `gib` GiB with the
    expert count closest to 8 (else the closest size; an expert is 66 MiB)."""
    fixed = 2 * VOCAB * HIDDEN * 2 + HIDDEN * 2
    best = None
    for layers in range(1, 257):
        for experts in range(2, 17):
            size = fixed + layers * _nbytes(layer_tensors(0, experts))
            err = abs(size - gib * 2**30)
            key = (err > 0.02 * gib * 2**30, abs(experts - 8), err)
            if best is None or key < best[0]:
                best = (key, layers, experts)
    return best[1], best[2]


def _values(rng, shape, dtype, pool):
    n = int(np.prod(shape))
    return np.resize(pool[rng.integers(0, 2**20) :], n).reshape(shape).astype(dtype, copy=False)


def _write(path: Path, entries, produce, shard_bytes: int) -> None:
    from expertax.convert.safetensors_io import plan_shards, write_file, write_index

    shards = plan_shards(entries, shard_bytes)
    path.mkdir(parents=True, exist_ok=True)
    for fname, shard in shards:
        write_file(path / fname, shard, ((n, produce(n, s, d)) for n, s, d in shard))
    if len(shards) > 1:
        write_index(path, shards)


def make_checkpoint(path: Path, gib: float, shard_bytes: int = 500 * 10**6) -> int:
    """A random bfloat16 Mixtral-shaped checkpoint of about `gib` GiB; returns its bytes."""
    layers, experts = mixtral_shape(gib)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        shapes |= layer_tensors(i, experts)
    shapes |= {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    rng = np.random.default_rng(0)
    pool = rng.standard_normal(2**22).astype(ml_dtypes.bfloat16)  # tiled: fast to produce
    entries = [(n, s, BF16) for n, s in shapes.items()]
    _write(path, entries, lambda n, s, d: _values(rng, s, d, pool), shard_bytes)
    (path / "config.json").write_text(json.dumps(hf_config(layers, experts)))
    return _nbytes(shapes)


def deepseek_config(layers: int, experts: int, dtype: str) -> dict:
    """DeepSeek-V3's hub config.json with fewer layers and experts and a small vocabulary."""
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "num_hidden_layers": layers,
        "first_k_dense_replace": 0,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "vocab_size": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
    }


def make_fp8_checkpoint(path: Path, gib: float, dtype: str = "bfloat16") -> int:
    """A DeepSeek-V3-shaped fp8 checkpoint of about `gib` GiB (random e4m3 values, NaN codes
    excluded, random block scales); `dtype` is its torch_dtype (what fp8 becomes); returns
    its bytes."""
    from expertax.convert import fp8, hf, hf_config, hf_write

    layers, experts = 1, 2
    while True:  # grow experts (to 16), then layers, until the size is reached
        c = hf_config.config_from_hf(deepseek_config(layers, experts, dtype))
        specs = hf.leaf_specs(c)
        entries = []
        for t in hf.tensor_map(c):
            shape = hf.hf_shape(t, tuple(specs[t.leaf].shape[len(t.index) :]))
            if hf_write.quantized(t) and len(shape) == 2:
                entries += [(t.hf_name, shape, fp8.FP8)]
                entries += [(fp8.scale_name(t.hf_name), fp8.scale_shape(shape), np.float32)]
            else:
                entries.append((t.hf_name, shape, np.float32 if "bias" in t.hf_name else BF16))
        size = sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in entries)
        if size >= gib * 2**30:
            break
        layers, experts = (layers, experts + 1) if experts < 16 else (layers + 1, 2)
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, 2**22, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaN
    pools = {
        np.dtype(fp8.FP8): codes.view(fp8.FP8),
        BF16: rng.standard_normal(2**22).astype(BF16),
        np.dtype(np.float32): rng.uniform(1e-4, 1e-3, 2**22).astype(np.float32),
    }
    _write(path, entries, lambda n, s, d: _values(rng, s, d, pools[np.dtype(d)]), 500 * 10**6)
    (path / "config.json").write_text(json.dumps(deepseek_config(layers, experts, dtype)))
    return size


def measure(direction: str, src: Path, dst: Path) -> dict:
    src_root = Path(__file__).resolve().parents[1] / "src"
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, direction, str(src), str(dst)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(src_root), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
        check=False,
    )
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def _run(rows: list, label: str, nbytes: int, runs) -> None:
    for direction, src, dst in runs:
        m = measure(direction, src, dst)
        row = {"checkpoint": label, "size_gib": nbytes / 2**30, "direction": direction, **m}
        row["gib_per_s"] = nbytes / 2**30 / m["wall_s"]
        row["params_per_s"] = m["params"] / m["wall_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1", help="bfloat16 checkpoint sizes, GiB, comma-separated")
    ap.add_argument("--fp8-gib", type=float, default=1.0, help="fp8 DeepSeek-shaped size; 0: none")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/convert-bench"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = ap.parse_args()
    rows: list[dict] = []
    for gib in [float(x) for x in args.sizes.split(",") if x]:
        base = args.dir / f"{gib:g}gib"
        shutil.rmtree(base, ignore_errors=True)
        t = time.perf_counter()
        nbytes = make_checkpoint(base / "hf", gib)
        layers, experts = mixtral_shape(gib)
        label = f"mixtral bf16 {layers}x{experts}"
        print(f"# {label}: {nbytes / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s", flush=True)
        runs = [("from-hf", base / "hf", base / "ours"), ("to-hf", base / "ours", base / "back")]
        _run(rows, label, nbytes, runs)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    if args.fp8_gib > 0:
        base = args.dir / "fp8"
        shutil.rmtree(base, ignore_errors=True)
        for dtype in ("bfloat16", "float32"):
            nbytes = make_fp8_checkpoint(base / f"hf-{dtype}", args.fp8_gib, dtype)
            print(f"# deepseek fp8 -> {dtype}: {nbytes / 2**30:.2f} GiB", flush=True)
            runs = [("from-hf", base / f"hf-{dtype}", base / f"ours-{dtype}")]
            if dtype == "bfloat16":
                runs.append(("to-hf", base / f"ours-{dtype}", base / "back"))
            _run(rows, f"deepseek fp8 -> {dtype}", nbytes, runs)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print("\n| checkpoint | size GiB | direction | wall s | GiB/s | peak RSS GiB | peak anon GiB |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['checkpoint']} | {r['size_gib']:.2f} | {r['direction']} | {r['wall_s']:.1f} "
            f"| {r['gib_per_s']:.2f} | {r['peak_rss_bytes'] / 2**30:.2f} "
            f"| {r['peak_anon_bytes'] / 2**30:.2f} |"
        )
    for r in rows:
        if r["checkpoint"].startswith("deepseek"):
            hours = DEEPSEEK_V3_PARAMS / r["params_per_s"] / 3600
            what = r["checkpoint"] if r["direction"] == "from-hf" else "bfloat16 -> HF bfloat16"
            print(
                f"estimate: DeepSeek-V3 {r['direction']} ({what}; hub checkpoint "
                f"{DEEPSEEK_V3_HUB_GIB} GiB) at {r['params_per_s'] / 1e9:.2f} G params/s: "
                f"about {hours:.1f} h"
            )


if __name__ == "__main__":
    main()
