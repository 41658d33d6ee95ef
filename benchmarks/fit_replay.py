"""A saved `expertax memory --fit --json` search replayed through today's estimate and
calibration: each compiled candidate estimated with the ratios the candidates compiled before it
teach (what the search would decide with), against its compiled peak. No compile: the peaks are
the report's own; each program's device arguments are taken as the estimate's (their ratio is
about 1 on these targets).

    PYTHONPATH=src python benchmarks/fit_replay.py REPORT.json [MODEL_KEYS ...]
"""

from __future__ import annotations

import json
import sys

from expertax import targets
from expertax.planner import calibrate
from expertax.planner.estimate import GIB, Estimator
from expertax.preflight import load_config

AXES = ("data", "fsdp", "context", "expert", "tensor")


def main(argv: list[str]) -> int:
    fit = json.load(open(argv[0]))["fit"]
    keys = dict(a.split("=", 1) for a in argv[1:])
    target = targets.parse_target(fit["target"])
    cal = calibrate.Calibration(target.platform)
    print("| # | candidate | placements | chunks | calibrated | compiled | error |")
    print("|---:|---|---|---:|---:|---:|---:|")
    n = 0
    for x in fit["candidates"]:
        if not x.get("peak_device_bytes"):
            continue
        o = x["overrides"]
        c = load_config(overrides={**keys, **o})
        shape = {"pipeline": 1, **{a: int(o.get(f"ici_{a}_parallelism", 1)) for a in AXES}}
        terms = Estimator(c, target.platform).terms(o, shape)
        chunks = o.get("num_moe_token_chunks")
        key = (tuple(shape.values()), o.get("sharding_rules"), chunks)
        estimate, peak = terms.peak(cal.ratios(key)), x["peak_device_bytes"]
        error = 100 * (estimate / peak - 1)
        n += 1
        print(
            f"| {n} | {x['layout']} | {x['remat']}, {x['offload']} | {chunks} | "
            f"{estimate / GIB:.2f} GiB | {peak / GIB:.2f} GiB | {error:+.1f} % |"
        )
        host = x.get("host_bytes") or 0
        cal.add(key, terms, calibrate.Measured(peak, terms.args, peak - terms.args, host))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
