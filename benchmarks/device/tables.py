"""The device check's Markdown tables, from its records (check.py writes them; BENCHMARKS.md's
"measured on a GPU" tables are these)."""

from __future__ import annotations

GIB = 1024**3


def _f(x, digits=1, scale=1.0) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _why(r: dict) -> str:
    return r.get("skipped") or r.get("error", "")[:80]


def markdown(records: list[dict]) -> str:
    by = lambda s: [r for r in records if r.get("section") == s]
    lines = []
    for h in by("host"):
        v = ", ".join(f"{k} {x}" for k, x in h.get("versions", {}).items())
        lines += [
            f"Device check on {h['devices']} x {h['device_kind']} ({h['platform']}), "
            f"{h['date']}, git {h.get('git') or '?'}{' (DRY RUN)' if h['dry_run'] else ''}; "
            f"{v}; load average {h['load_average']}",
            "",
        ]
    for r in by("dense"):
        lines += [
            f"Dense matmul {r['shape']} {r['dtype']}: {_f(r['tflops'])} TFLOP/s "
            f"(data sheet: {r['spec_tflops']:g})",
            "",
        ]
    checks = [f"{r['backend']}: {_f(r.get('max_rel_err_vs_tiled'), 4)}" for r in by("gmm_check")]
    if checks:
        lines += ["Grouped matmul against tiled (max relative error): " + ", ".join(checks), ""]
    gmm = by("gmm")
    if gmm:
        lines += ["Grouped matmul, TFLOP/s on routed FLOPs (x the dense matmul of the same rows):"]
        keys = sorted(
            {(r["shape"], r["rows_per_expert"], r["mode"]) for r in gmm},
            key=lambda k: (k[0], k[2], k[1]),
        )
        backends = [
            b
            for b in ("dense", "tokamax_triton", "tokamax_mosaic_gpu", "ragged_dot", "tiled")
            if any(r["backend"] == b for r in gmm)
        ]
        rows = []
        for shape, n, mode in keys:
            cells = []
            for b in backends:
                r = next(
                    (
                        x
                        for x in gmm
                        if (x["shape"], x["rows_per_expert"], x["mode"], x["backend"])
                        == (shape, n, mode, b)
                    ),
                    None,
                )
                if r is None or "tflops" not in r:
                    cells.append("-" if r is None else _why(r) or "-")
                elif b == "dense":
                    cells.append(_f(r["tflops"]))
                else:
                    cells.append(f"{_f(r['tflops'])} ({_f(r['vs_dense'], 2)}x)")
            rows.append([shape, str(n), mode, *cells])
        lines += _table(["shape", "rows/expert", "pass", *backends], rows) + [""]
    att = by("attention")
    if att:
        lines += ["Attention forward + backward, TFLOP/s on causal FLOPs (x dot's speed):"]
        rows = []
        for r in att:
            cell = _why(r) or f"{_f(r['tflops'])} ({_f(r.get('vs_dot'), 2)}x)"
            rows.append([r["shape"], str(r["length"]), r["impl"], cell])
        lines += _table(["heads", "length", "impl", "TFLOP/s"], rows) + [""]
    for r in by("train"):
        peak, planned = r.get("peak_bytes_in_use"), r.get("planned_peak_bytes")
        lines += _table(
            [
                "plan",
                "layers",
                "params",
                "batch",
                "step s",
                "tokens/s",
                "MFU (data sheet)",
                "MFU (measured dense)",
                "peak GiB",
                "compiled GiB",
                "planned GiB",
            ],
            [
                [
                    str(r["plan"]),
                    str(r["layers"]),
                    f"{r['parameters'] / 1e9:.2f}B",
                    r["batch"],
                    _f(r["step_s"], 3),
                    _f(r["tokens_per_s"], 0),
                    _f(r["mfu_spec"], 1, 100) + "%",
                    _f(r["mfu_measured_peak"], 1, 100) + "%",
                    _f(peak, 2, 1 / GIB),
                    _f(r["compiled_peak_bytes"], 2, 1 / GIB),
                    _f(planned, 2, 1 / GIB),
                ]
            ],
        ) + [f"Plan: {r['overrides']}", ""]
    dec = by("decode")
    if dec:
        lines += _table(
            ["decode batch", "prompt", "new", "prefill + 1 token s", "tokens/s"],
            [
                [
                    str(r["batch"]),
                    str(r["prompt"]),
                    str(r["new_tokens"]),
                    _f(r["prefill_s"], 3),
                    _f(r["tokens_per_s"], 1),
                ]
                for r in dec
            ],
        ) + [""]
    for r in by("fp8"):
        lines += [f"fp8: {_why(r)}", ""]
    notes = [f"{r['of']}: {r.get('note') or r.get('seconds_note')}" for r in by("status")]
    if notes:
        lines += ["Sections: " + "; ".join(notes), ""]
    return "\n".join(lines)
