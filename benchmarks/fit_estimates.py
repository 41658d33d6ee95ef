"""The fit search's estimate, as the current planner computes it, against the compiled peak of
every compiled candidate of saved `expertax memory --fit --json` reports: one JSON line per
candidate, then a table. Two estimates per candidate:

- at the priors: what a search's first compile is chosen by;
- calibrated: the report's search replayed through today's calibration, each candidate with the
  ratios its report's candidates compiled before it teach (what the search would decide with).
  The replay's working key is the layout, rules and MoE chunk count (the search's also has the
  attention chunks, tile and stash, alike within these reports), and each program's device
  arguments are taken as the estimate's (their ratio is about 1 on these targets).

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

AXES = ("data", "fsdp", "context", "expert", "tensor")


def _rows(path: str, keys: dict[str, str]) -> list[dict]:
    """One row per compiled candidate of the report at `path`, in compile order."""
    fit = json.load(open(path))["fit"]
    target = targets.parse_target(fit["target"])
    prior = calibrate.Calibration(target.platform).ratios()
    replay = calibrate.Calibration(target.platform)
    rows = []
    for x in fit["candidates"]:
        if not x.get("peak_device_bytes"):
            continue
        o = x["overrides"]
        c = load_config(overrides={**keys, **o})
        shape = {"pipeline": 1, **{a: int(o.get(f"ici_{a}_parallelism", 1)) for a in AXES}}
        terms = Estimator(c, target.platform).terms(o, shape)
        key = (tuple(shape.values()), o["sharding_rules"], o.get("num_moe_token_chunks", 1))
        peak = x["peak_device_bytes"]
        row = {
            "report": path.rsplit("/", 1)[-1],
            "target": fit["target"],
            "layout": x["layout"],
            "remat": x["remat"],
            "offload": x["offload"],
            "chunks": key[2],
            "estimate_gib": round(terms.peak(prior) / GIB, 2),
            "calibrated_gib": round(terms.peak(replay.ratios(key)) / GIB, 2),
            "compiled_gib": round(peak / GIB, 2),
        }
        for k in ("estimate", "calibrated"):
            row[f"{k}_error"] = round(row[f"{k}_gib"] / row["compiled_gib"] - 1, 4)
        rows.append(row)
        host = x.get("host_bytes") or 0
        replay.add(key, terms, calibrate.Measured(peak, terms.args, peak - terms.args, host))
    return rows


def main(argv: list[str]) -> int:
    keys = dict(a.split("=", 1) for a in argv if "=" in a)
    rows = [r for a in argv if a.endswith(".json") for r in _rows(a, keys)]
    for r in rows:
        print(json.dumps(r))
    print(
        "| target | candidate | placements | chunks | at the priors | error | calibrated "
        "| error | compiled |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['target']} | {r['layout']} | {r['remat']}, {r['offload']} | {r['chunks']} | "
            f"{r['estimate_gib']:.2f} GiB | {100 * r['estimate_error']:+.1f} % | "
            f"{r['calibrated_gib']:.2f} GiB | {100 * r['calibrated_error']:+.1f} % | "
            f"{r['compiled_gib']:.2f} GiB |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
