"""plans.json for the device check's train step: per GPU kind, the most layers of the device
check's DeepSeek-V3-shaped model (model.MODEL) for which `expertax memory --fit` finds a plan on
one GPU of that kind (its own compiler, here on a CPU machine; no host offload, so that the step
measures the GPU, not its host link), and that plan.

Run (a few minutes per GPU kind on 2 cores): PYTHONPATH=src python benchmarks/device/plan.py
     [--gpus h100,h200] [--layers 24,20,16,14,12,10,8] [--batch 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from expertax import startup  # noqa: E402

startup.prepare()

import model  # noqa: E402

from expertax.planner.fit import fit_search  # noqa: E402
from expertax.preflight import load_config  # noqa: E402
from expertax.targets import parse_target, prepare_process  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="h100,h200")
    p.add_argument("--layers", default="24,20,16,14,12,10,8")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--out", default=str(model.PLANS))
    args = p.parse_args()
    plans = json.loads(Path(args.out).read_text()) if os.path.exists(args.out) else {}
    for gpu in args.gpus.split(","):
        target = parse_target(f"gpu:{gpu}x1")
        prepare_process(target)
        for layers in (int(n) for n in args.layers.split(",")):
            fixed = {
                "base_num_decoder_layers": layers,
                "per_device_batch_size": args.batch,
                # MLA's 192-wide q/k: cuDNN takes it on the GPU itself, but a compile without
                # one is held to 128 (nn/attention/cudnn.py); the plan is what both compile.
                "attention_impl": "blockwise",
            }
            c = load_config(overrides={**model.MODEL, **fixed})
            t0 = time.perf_counter()
            r = fit_search(c, 1, target.hbm_gib, hardware=target, max_compiles=4, offload=False)
            print(f"{gpu}: {layers} layers: fits={r['fits']} in {r['seconds']} s", flush=True)
            if r["fits"]:
                plans[gpu] = {
                    "overrides": {**fixed, **r["best"]["overrides"]},
                    "compiled_peak_bytes": r["best"]["peak_device_bytes"],
                    "hbm_gib": target.hbm_gib,
                    "fit_seconds": round(time.perf_counter() - t0, 1),
                    "command": r["train_line"],
                }
                break
    Path(args.out).write_text(json.dumps(plans, indent=1) + "\n")
    print(json.dumps(plans, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
