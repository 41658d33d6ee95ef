"""The fit search's estimate, as the current planner computes it at its priors (what a search's
first compile is chosen by), against the compiled peak of every compiled candidate of saved
`expertax memory --fit --json` reports: one JSON line per candidate, then a table.

    PYTHONPATH=src python benchmarks/fit_estimates.py REPORT.json [MODEL_KEYS ...]

MODEL_KEYS: the search's model keys (`model_name=deepseek3-671b per_device_batch_size=4
max_target_length=8192`). No compile: the compiled figures are the reports' own.
"""

from __future__ import annotations

import json
import sys

from expertax import targets
from expertax.planner import calibrate
from expertax.planner.estimate import GIB, Estimator
from expertax.preflight import load_config


def main(argv: list[str]) -> int:
    reports = [a for a in argv if a.endswith(".json")]
    keys = dict(a.split("=", 1) for a in argv if "=" in a)
    rows = []
    for path in reports:
        fit = json.load(open(path))["fit"]
        target = targets.parse_target(fit["target"])
        for x in fit["candidates"]:
            if not x.get("peak_device_bytes"):
                continue
            o = x["overrides"]
            c = load_config(overrides={**keys, **o})
            est = Estimator(c, target.platform)
            shape = {
                a: int(o.get(f"ici_{a}_parallelism", 1))
                for a in ("data", "fsdp", "context", "expert", "tensor")
            }
            shape = {"pipeline": 1, **shape}
            prior = calibrate.Calibration(target.platform).ratios()
            terms = est.terms(o, shape)
            row = {
                "report": path.rsplit("/", 1)[-1],
                "target": fit["target"],
                "layout": x["layout"],
                "remat": x["remat"],
                "offload": x["offload"],
                "estimate_gib": round(terms.peak(prior) / GIB, 2),
                "compiled_gib": round(x["peak_device_bytes"] / GIB, 2),
            }
            row["error"] = round(row["estimate_gib"] / row["compiled_gib"] - 1, 4)
            print(json.dumps(row))
            rows.append(row)
    print("| target | candidate | placements | estimate | compiled | error |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['target']} | {r['layout']} | {r['remat']}, {r['offload']} | "
            f"{r['estimate_gib']:.2f} GiB | {r['compiled_gib']:.2f} GiB | "
            f"{100 * r['error']:+.1f} % |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
