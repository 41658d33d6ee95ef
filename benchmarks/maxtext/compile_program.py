"""Compile one of MaxText's own train steps for a TPU slice (its `train_compile`, no TPU needed)
and save the optimized HLO where `expertax steptime` reads it, with the facts beside it
(PROGRAM.meta.json: the target, the mesh, each device's torus coordinates, MaxText's own
TFLOPs per device and step, tokens per device and step).

Runs in MaxText's environment, not expertax's (MaxText needs Python >= 3.12 and its own JAX):

    python3.12 -m venv mt && mt/bin/pip install "maxtext[tpu]==0.2.5"
    LIBTPU_INIT_ARGS="..." mt/bin/python benchmarks/maxtext/compile_program.py OUT.hlo \
        tpu:v5p-128 model_name=mixtral-8x7b per_device_batch_size=36 ...

(benchmarks/maxtext/validate.sh runs the recipes; BENCHMARKS.md has the table.)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time


def main() -> int:
    out, target, *keys = sys.argv[1:]
    kind, _, cores = target.removeprefix("tpu:").partition("-")
    from maxtext.trainers.pre_train import train_compile

    import maxtext

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    argv = ["train_compile", base, f"compile_topology={kind}-{cores}"]
    argv += ["compile_topology_num_slices=1", "enable_checkpointing=false"]
    argv += ["dataset_type=synthetic", *keys]
    captured = {}
    original = train_compile.jit_and_compile

    def keep(*args, **kwargs):
        compiled = original(*args, **kwargs)
        captured["compiled"] = compiled
        captured["mesh"] = args[3]
        captured["config"] = args[8]
        return compiled

    train_compile.jit_and_compile = keep
    t0 = time.perf_counter()
    train_compile.main(argv)
    seconds = time.perf_counter() - t0
    compiled, mesh, config = captured["compiled"], captured["mesh"], captured["config"]
    from maxtext.utils import maxtext_utils

    tflops, _, _ = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
    with open(out, "w") as f:
        f.write(compiled.as_text())
    devices = list(mesh.devices.flat)
    meta = {
        "target": target,
        "mesh": [[a, int(n)] for a, n in zip(mesh.axis_names, mesh.devices.shape)],
        "coords": [list(d.coords) for d in devices],
        "placement": "MaxText's mesh's device coordinates",
        "model_flops": tflops * 1e12,
        "tokens": config.per_device_batch_size * config.max_target_length,
        "program": "MaxText " + getattr(maxtext, "__version__", "0.2.5") + " train_compile",
        "keys": keys,
        "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
        "compile_seconds": round(seconds, 1),
        "devices": math.prod(mesh.devices.shape),
    }
    with open(out + ".meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    print(f"saved {out} ({os.path.getsize(out) / 1e6:.1f} MB) in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
