"""Multi-token prediction (models/mtp.py) on deepseek3-tiny: losses, acceptance and step time.

`--steps` steps on one CPU device, with and without MTP (mtp_num_layers=1,
mtp_loss_scaling_factor=0.3), on two data sources: the synthetic stream and a small real English
corpus (the package descriptions in this Python environment's `*.dist-info/METADATA` files and the
licence texts of /usr/share/common-licenses, when present), tokenized by a byte-level BPE trained
on it at the model's vocabulary (512). Each run evaluates once at the end on held-out data (the
synthetic stream's other seed; for the corpus, every 10th document, kept out of training).

Per run: final train loss, final MTP loss, eval loss, eval MTP loss and the MTP head's top-1
acceptance, and the median step time over steps >= `--skip`; runs alternate with and without MTP
for `--rounds` rounds and the step time is the median over rounds. The target: step time with
MTP <= 1.15 x without, at D = 1.

`--layers N` deepens the model (the MTP module is one decoder block: its share of the step falls
as the main stack grows).

Run: python benchmarks/mtp.py [--steps 200] [--rounds 3] [--layers N] [--data synthetic corpus]
Prints JSON lines, then a Markdown table. Measure alone.
"""

from __future__ import annotations

import argparse
import email
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

VOCAB = 512  # deepseek3-tiny's vocab_size
BOS, EOS = "<bos>", "<eos>"


def corpus_texts() -> list[str]:
    """Package descriptions (METADATA bodies) and licence texts: real English prose and docs."""
    texts = []
    site = [p for p in sys.path if p.endswith("site-packages")]
    for meta in sorted(glob.glob(os.path.join(site[0], "*.dist-info", "METADATA"))):
        body = email.message_from_string(Path(meta).read_text(errors="replace")).get_payload()
        if isinstance(body, str) and len(body) > 200:
            texts.append(body)
    for path in sorted(glob.glob("/usr/share/common-licenses/*")):
        if os.path.isfile(path):
            texts.append(Path(path).read_text(errors="replace"))
    return texts


def write_corpus(root: Path) -> tuple[str, str, str, int]:
    """(train jsonl, eval jsonl, tokenizer.json, characters) under `root`."""
    texts = corpus_texts()
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok_path = root / "tokenizer.json"
    tok.save(str(tok_path))
    train_docs = [t for i, t in enumerate(texts) if i % 10]
    eval_docs = [t for i, t in enumerate(texts) if i % 10 == 0]
    for name, docs in (("train", train_docs), ("eval", eval_docs)):
        (root / name).mkdir()
        with open(root / name / "docs.jsonl", "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
    chars = sum(len(t) for t in texts)
    return str(root / "train"), str(root / "eval"), str(tok_path), chars


def run(out: Path, name: str, args, extra: list[str]) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    cmd = [sys.executable, "-m", "expertax.cli", "train", "model_name=deepseek3-tiny"]
    cmd += [f"steps={args.steps}", "log_period=50", "enable_checkpointing=false"]
    cmd += [f"eval_interval={args.steps}", "eval_steps=4", "enable_tensorboard=false"]
    cmd += [f"base_output_directory={out}", f"run_name={name}", *extra]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out / name / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    last, ev = recs[-1], [r for r in recs if "eval_loss" in r][-1]
    return {
        "step_time_s": statistics.median(r["step_time_s"] for r in recs[args.skip :]),
        "loss": last["loss"],
        "mtp_loss": last.get("mtp_loss"),
        "eval_loss": ev["eval_loss"],
        "eval_mtp_loss": ev.get("eval_mtp_loss"),
        "eval_mtp_acceptance": ev.get("eval_mtp_acceptance"),
    }


def fmt(x, spec=".4f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument(
        "--layers", type=int, default=0, help="base_num_decoder_layers (0: the preset's 3)"
    )
    ap.add_argument("--data", nargs="+", default=["synthetic", "corpus"])
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    variants = {
        "no MTP": [],
        "MTP D=1, lambda=0.3": ["mtp_num_layers=1", "mtp_loss_scaling_factor=0.3"],
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        train_dir, eval_dir, tok, chars = write_corpus(Path(tmp))
        print(f"corpus: {chars} characters, tokenizer: byte-level BPE, {VOCAB} tokens", flush=True)
        corpus = [
            "dataset_type=files",
            f"dataset_path={train_dir}",
            f"eval_dataset_path={eval_dir}",
            f"tokenizer_path={tok}",
        ]
        depth = [f"base_num_decoder_layers={args.layers}"] if args.layers else []
        for data, extra in (("synthetic", depth), ("corpus", corpus + depth)):
            if data not in args.data:
                continue
            results: dict[str, list[dict]] = {v: [] for v in variants}
            for r in range(args.rounds):
                for v, keys in variants.items():
                    name = f"{data}-{v.split(',')[0].replace(' ', '_')}-{r}"
                    results[v].append(run(Path(tmp), name, args, [*extra, *keys]))
            base = statistics.median(x["step_time_s"] for x in results["no MTP"])
            for v, rs in results.items():
                t = statistics.median(x["step_time_s"] for x in rs)
                row = {"data": data, "variant": v, **rs[-1], "step_time_s": t}
                row["step_time_ratio"] = t / base
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"load average after: {os.getloadavg()}")
    print()
    print(
        "| data | variant | final loss | final MTP loss | eval loss | eval MTP loss | "
        "acceptance | median step (ms) | x no MTP |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['data']} | {r['variant']} | {fmt(r['loss'])} | {fmt(r['mtp_loss'])} | "
            f"{fmt(r['eval_loss'])} | {fmt(r['eval_mtp_loss'])} | "
            f"{fmt(r['eval_mtp_acceptance'], '.3f')} | {r['step_time_s'] * 1e3:.1f} | "
            f"{r['step_time_ratio']:.3f} |"
        )


if __name__ == "__main__":
    main()
