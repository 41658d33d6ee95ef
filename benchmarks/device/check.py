"""The device check: what expertax's kernels, train step and decoding do on one real GPU, in one
command of at most 8 minutes (README.md here says how to run it on the GPU machine).

Sections, in this order, each in its own Python process with what is left of the time budget (a
section that runs out or crashes loses only what it had not yet written):
- `dense`: the chip's dense bf16 matmul rate (the baseline of every ratio and of the measured-peak
  MFU);
- `gmm_check`: every grouped-matmul backend against `tiled` on one small case (a wrong kernel
  must not win a table);
- `gmm`: the grouped-matmul backends at DeepSeek-V3 and Qwen3-MoE expert shapes, 128-2048 rows per
  expert, forward and forward + backward, against the dense matmul of the same rows;
- `attention`: cuDNN, blockwise and dot attention, GQA and MLA head dims, forward + backward,
  against dot;
- `train`: the largest DeepSeek-V3-shaped model that fits the GPU (plans.json), step time,
  tokens/s, MFU, peak memory against the compiled plan; then `decode` at batch 1 and 32;
- `fp8`: fp8 GEMMs, where the checkout has fp8 training (skipped, saying so, where not).

Output in `--out` (default $OUT, else ./device-check): `device-check.jsonl` (one JSON object per
line: first the host, then every measurement as it is made), `device-check.json` (all of it) and
`device-check.md` (the tables). `--dry-run` runs every section on the CPU with tiny shapes, so
the check never rots (tests/unit/tools/test_device_check.py runs it).

Run: python benchmarks/device/check.py [--dry-run] [--out DIR] [--budget-s 450]
     [--sections dense,gmm_check,gmm,attention,train,fp8]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform as host_platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
SECTIONS = ("dense", "gmm_check", "gmm", "attention", "train", "fp8")
# Each section's share of the budget when it starts (of what is left then): the kernel grids
# are many small programs, the train step one large compile.
SHARE = {
    "host": 0.05,
    "dense": 0.05,
    "gmm_check": 0.05,
    "gmm": 0.4,
    "attention": 0.35,
    "train": 1.0,
    "fp8": 1.0,
}
SPEC_TFLOPS = {"h100": 989.0, "h200": 989.0}  # dense bf16, SXM, per the vendor's data sheet


@dataclasses.dataclass
class Context:
    """What a section gets: the mode, the clock and where its records go."""

    dry_run: bool
    deadline: float  # time.time() by which the section must stop starting measurements
    out: Path
    device_kind: str = ""
    spec_tflops: float = 989.0
    dense_tflops: float | None = None
    repeats: int = 5

    def out_of_time(self) -> bool:
        return time.time() > self.deadline

    def emit(self, record: dict) -> None:
        record = {"time": round(time.time(), 3), **record}
        with (self.out / "device-check.jsonl").open("a") as f:
            f.write(json.dumps(record, default=_plain) + "\n")
        print(json.dumps(record, default=_plain), flush=True)


def _plain(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def host_record(dry_run: bool) -> dict:
    import jax

    dev = jax.devices()[0]
    versions = {}
    for pkg in ("jax", "jaxlib", "tokamax", "jax_cuda13_plugin", "jax_cuda12_plugin"):
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg.replace("_", "-"))
        except Exception:  # noqa: BLE001 - not installed
            continue
    return {
        "section": "host",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "dry_run": dry_run,
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "devices": jax.device_count(),
        "python": sys.version.split()[0],
        "machine": host_platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "versions": versions,
        "git": _git_head(),
    }


def _git_head() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip()
    except Exception:  # noqa: BLE001 - no git on the device
        return ""


def run_section(name: str, ctx: Context) -> None:
    """One section, in this process (the child of `main`)."""
    import kernels  # noqa: PLC0415 - beside this file

    if name == "host":
        ctx.emit(host_record(ctx.dry_run))
        return

    if name == "fp8":
        # fp8 training (quantization=...) is not in this checkout: the section says so. The
        # fp8 work adds its GEMM timings here, against the bf16 GEMMs of the same shapes.
        from expertax.config.schema import Config  # noqa: PLC0415

        why = "this checkout has no fp8 training"
        if "quantization" in Config.model_fields:
            why = "fp8 training exists, but this check has no fp8 section yet"
        ctx.emit({"section": "fp8", "skipped": why})
        return
    if name == "train":
        import model  # noqa: PLC0415

        model.train_step(ctx)
        return
    {
        "dense": kernels.dense_peak,
        "gmm_check": kernels.gmm_reference_check,
        "gmm": kernels.grouped_matmul,
        "attention": kernels.attention_kernels,
    }[name](ctx)


def _child(args) -> int:
    import jax

    ctx = Context(args.dry_run, args.deadline, Path(args.out))
    ctx.device_kind = jax.devices()[0].device_kind
    ctx.spec_tflops = next(
        (v for k, v in SPEC_TFLOPS.items() if k in ctx.device_kind.lower()), 989.0
    )
    ctx.dense_tflops = args.dense_tflops
    ctx.repeats = 2 if args.dry_run else 5
    run_section(args.section, ctx)
    return 0


def _records(out: Path) -> list[dict]:
    path = out / "device-check.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "device-check"))
    p.add_argument("--budget-s", type=float, default=450.0)
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--section", help=argparse.SUPPRESS)  # a child: run this one section
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--dense-tflops", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        p.error(f"--sections: unknown {unknown}; valid: {','.join(SECTIONS)}")
    if args.section:
        return _child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device-check.jsonl").unlink(missing_ok=True)
    start = time.time()
    end = start + args.budget_s
    env = _child_env(args.dry_run)
    for name in ("host", *sections):
        left = end - time.time()
        if left < 5:
            _note(out, name, "skipped: the time budget was spent")
            continue
        deadline = time.time() + SHARE[name] * left
        dense = next((r["tflops"] for r in _records(out) if r.get("section") == "dense"), None)
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--section",
            name,
            "--deadline",
            str(deadline),
            "--out",
            str(out),
        ]
        cmd += ["--dry-run"] if args.dry_run else []
        cmd += ["--dense-tflops", str(dense)] if dense else []
        t0 = time.time()
        try:
            # A section stops starting measurements at its deadline; the hard limit adds the
            # time one last measurement (a compile) may take.
            r = subprocess.run(
                cmd, env=env, timeout=max(10.0, end - time.time()), capture_output=True, text=True
            )
            if r.returncode:
                _note(out, name, f"failed (exit {r.returncode}): {r.stderr.strip()[-1500:]}")
        except subprocess.TimeoutExpired:
            _note(out, name, "cut off at the end of the time budget")
        _note(out, name, f"took {time.time() - t0:.1f} s", key="seconds_note")
    records = _records(out)
    (out / "device-check.json").write_text(
        json.dumps({"seconds": round(time.time() - start, 1), "records": records}, indent=1)
    )
    import tables  # noqa: PLC0415

    text = tables.markdown(records)
    (out / "device-check.md").write_text(text)
    print(text)
    return 0


def _note(out: Path, section: str, text: str, key: str = "note") -> None:
    Context(False, 0.0, out).emit({"section": "status", "of": section, key: text})


def _child_env(dry_run: bool) -> dict:
    """The children's environment: this checkout's src/ and this folder importable; on the CPU
    (dry run) JAX on the CPU only."""
    env = dict(os.environ)
    paths = [str(SRC), str(HERE), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if dry_run:
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


if __name__ == "__main__":
    sys.exit(main())
