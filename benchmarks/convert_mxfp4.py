"""`expertax convert from-hf` on a GPT-OSS-20B-shaped MXFP4 checkpoint: read rate and peak RSS.

    python benchmarks/convert_mxfp4.py [--layers 24] [--dir /tmp/convert-mxfp4] [--keep]
        [--workers 2] [--dtype bfloat16]

Writes a checkpoint in the hub's layout (gpt-oss-20b's shapes: hidden 2880, 32 experts of
2880, 64 query and 8 kv heads of 64, vocabulary 201088; the experts' weights as MXFP4 blocks
and scales, everything else bfloat16; random bytes, ~500 MB shards) with `--layers` layers
(24: ~12.8 GiB, the real model's size, and its bfloat16 output ~37 GiB more, float32 twice
that: check `df -h` first), then runs the CLI
(`python -m expertax.cli convert from-hf`) in a child process, its peak RSS from
getrusage(RUSAGE_CHILDREN). The targets: >= 0.5 GiB/s read, peak RSS <= 2.5 GiB.

The baseline, in the same run: the disk's floor for the conversion's output, the same bytes
(the size of the converted params/) written as 64 MiB files by `--workers` threads, each file
synced and dropped from the page cache as the converter's writer does (model_dir.settle), no
computing; and the read rate that floor would allow.

Prints one JSON line per run and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from convert import BF16, _write  # benchmarks/convert.py

HIDDEN, FFN, EXPERTS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2880, 2880, 32, 64, 8, 64, 201088
GIB_TARGET, RSS_TARGET_GIB = 0.5, 2.5
U8 = np.dtype(np.uint8)


def hf_config(layers: int, dtype: str) -> dict:
    """gpt-oss-20b's config.json, `layers` layers."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": layers,
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "attention_bias": True,
        "hidden_act": "silu",
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)
        + ["sliding_attention"] * (layers % 2),
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "max_position_embeddings": 131072,
        "initial_context_length": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },  # fmt: skip
        "router_aux_loss_coef": 0.9,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },  # fmt: skip
    }


def layer_entries(i: int) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    p, q, kv = f"model.layers.{i}.", HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    g = HIDDEN // 32  # MXFP4 blocks per row of gate_up_proj (in: hidden) and of down_proj (F)
    out = [
        (p + "input_layernorm.weight", (HIDDEN,), BF16),
        (p + "post_attention_layernorm.weight", (HIDDEN,), BF16),
        (p + "self_attn.q_proj.weight", (q, HIDDEN), BF16),
        (p + "self_attn.q_proj.bias", (q,), BF16),
        (p + "self_attn.k_proj.weight", (kv, HIDDEN), BF16),
        (p + "self_attn.k_proj.bias", (kv,), BF16),
        (p + "self_attn.v_proj.weight", (kv, HIDDEN), BF16),
        (p + "self_attn.v_proj.bias", (kv,), BF16),
        (p + "self_attn.o_proj.weight", (HIDDEN, q), BF16),
        (p + "self_attn.o_proj.bias", (HIDDEN,), BF16),
        (p + "self_attn.sinks", (HEADS,), BF16),
        (p + "mlp.router.weight", (EXPERTS, HIDDEN), BF16),
        (p + "mlp.router.bias", (EXPERTS,), BF16),
        (p + "mlp.experts.gate_up_proj_blocks", (EXPERTS, 2 * FFN, g, 16), U8),
        (p + "mlp.experts.gate_up_proj_scales", (EXPERTS, 2 * FFN, g), U8),
        (p + "mlp.experts.gate_up_proj_bias", (EXPERTS, 2 * FFN), BF16),
        (p + "mlp.experts.down_proj_blocks", (EXPERTS, HIDDEN, FFN // 32, 16), U8),
        (p + "mlp.experts.down_proj_scales", (EXPERTS, HIDDEN, FFN // 32), U8),
        (p + "mlp.experts.down_proj_bias", (EXPERTS, HIDDEN), BF16),
    ]
    return out


def make_checkpoint(path: Path, layers: int, dtype: str, shard_bytes: int = 500 * 10**6) -> int:
    """The checkpoint; returns its bytes. Random bytes: bfloat16 values of a small pool, codes
    uniform, scales 2^-8 .. 2^-1 (never the NaN scale)."""
    entries = [("model.embed_tokens.weight", (VOCAB, HIDDEN), BF16)]
    for i in range(layers):
        entries += layer_entries(i)
    entries += [("model.norm.weight", (HIDDEN,), BF16), ("lm_head.weight", (VOCAB, HIDDEN), BF16)]
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(2**20) * 0.02).astype(BF16)
    codes = rng.integers(0, 256, 2**24, dtype=np.uint8)

    def produce(name: str, shape: tuple[int, ...], dt: np.dtype) -> np.ndarray:
        n = int(np.prod(shape))
        if name.endswith("_scales"):
            return rng.integers(119, 127, n, dtype=np.uint8).reshape(shape)
        source = codes if dt == U8 else pool
        start = int(rng.integers(0, source.size))
        return np.resize(source[start:], n).reshape(shape)

    _write(path, entries, produce, shard_bytes)
    (path / "config.json").write_text(json.dumps(hf_config(layers, dtype)))
    return sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in entries)


def run_cli(src: Path, dst: Path, workers: int) -> dict:
    """`expertax convert from-hf` in a child process: wall seconds and its peak RSS."""
    src_root = Path(__file__).resolve().parents[1] / "src"
    cmd = [sys.executable, "-m", "expertax.cli", "convert", "from-hf", str(src), str(dst),
           "--workers", str(workers)]  # fmt: skip
    t = time.perf_counter()
    r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(src_root), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
        check=False,
    )
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the only child
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,  # beside wall: how loaded the machine was
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "cli": r.stdout.strip().splitlines()[-1],
    }


def write_floor(directory: Path, nbytes: int, workers: int) -> float:
    """Seconds to write `nbytes` as 64 MiB files from `workers` threads, each file synced and
    dropped from the page cache (model_dir.settle) before the next: the disk's floor for the
    conversion's writes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from expertax.train.model_dir import settle

    directory.mkdir(parents=True, exist_ok=True)
    chunk = np.random.default_rng(0).integers(0, 256, 64 * 2**20, dtype=np.uint8).tobytes()
    files = -(-nbytes // len(chunk))

    def worker(k: int) -> None:
        for f in range(k, files, workers):
            path = directory / f"{f}.bin"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view, done = memoryview(chunk), 0
                while done < len(view):
                    done += os.write(fd, view[done:])
                settle(fd)
            finally:
                os.close(fd)
            path.unlink()

    t = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="24: gpt-oss-20b's (~12.8 GiB)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/convert-mxfp4"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the checkpoint (the converted output is removed to make room for the baseline)",
    )
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    t = time.perf_counter()
    nbytes = make_checkpoint(args.dir / "hf", args.layers, args.dtype)
    made = time.perf_counter() - t
    print(f"# gpt-oss-20b-shaped MXFP4, {args.layers} layers: {nbytes / 2**30:.2f} GiB written "
          f"in {made:.1f} s", flush=True)  # fmt: skip
    m = run_cli(args.dir / "hf", args.dir / "ours", args.workers)
    row = {
        "checkpoint": f"gpt-oss mxfp4 {args.layers}x{EXPERTS}",
        "layers": args.layers,
        "into": args.dtype,
        "workers": args.workers,
        "size_gib": nbytes / 2**30,
        **m,
        "gib_per_s": nbytes / 2**30 / m["wall_s"],
    }
    out_bytes = sum(f.stat().st_size for f in (args.dir / "ours").rglob("*") if f.is_file())
    shutil.rmtree(args.dir / "ours", ignore_errors=True)  # room for the floor's files
    floor = write_floor(args.dir / "floor", out_bytes, args.workers)
    row.update({"output_gib": out_bytes / 2**30, "write_floor_s": floor,
                "floor_gib_per_s": nbytes / 2**30 / floor})  # fmt: skip
    print(json.dumps(row), flush=True)
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(
        "\n| checkpoint | into | size GiB | output GiB | wall s | CPU s | GiB/s read | peak RSS "
        "GiB | baseline: output bytes written alone, s | read rate it allows |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {row['checkpoint']} | {args.dtype} | {row['size_gib']:.2f} | "
          f"{row['output_gib']:.2f} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | "
          f"{row['gib_per_s']:.2f} | {row['peak_rss_bytes'] / 2**30:.2f} | {floor:.1f} | "
          f"{row['floor_gib_per_s']:.2f} |")  # fmt: skip
    print(f"targets: >= {GIB_TARGET} GiB/s read, peak RSS <= {RSS_TARGET_GIB} GiB")


if __name__ == "__main__":
    main()
