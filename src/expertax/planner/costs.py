"""What one compiled train step computes, per device, against what the model needs.

- `model_flops`: the model's training FLOPs per device per step (`train.metrics`:
  6 x matmul parameters used per token + causal attention, times the tokens a device takes).
- `compiled_flops`: the matmul and convolution FLOPs of the compiled program, read from its
  optimized HLO (`flops.count_flops`), each loop body multiplied by its trip count. The
  compilers' own `cost_analysis()` counts a loop body once (a scanned 61-layer step reports about
  one layer's flops) and the GPU compiler has none without a GPU; both targets are counted the same
  way here. Elementwise work is not in this figure.
- TPU only: a roofline estimate of the step and the MFU it bounds (model FLOPs / (roofline x
  the chip's peak)): the compiler's own (`cost_analysis()["optimal_seconds"]`, loop bodies once)
  scaled to the whole step by the ratio of trip-weighted to once-counted matmul FLOPs; where the
  compiler gives none (it reports a negative figure for programs with data-dependent loops, as
  every MoE step has), max(compiled FLOPs / peak FLOP/s, XLA's bytes accessed scaled the same
  way / HBM bandwidth). An estimate, never a measured time.
"""

from __future__ import annotations

from expertax import platform
from expertax.config.schema import Config
from expertax.planner import flops
from expertax.train import muon
from expertax.train.metrics import train_flops_per_token

METHOD = (
    "matmul/convolution FLOPs of the optimized HLO, each loop body x its trip count "
    "(planner/flops.py)"
)


TOP_OPS = 24  # the report's largest FLOP sources by op_name


def model_flops_per_device(c: Config, global_batch: int, devices: int) -> float:
    return train_flops_per_token(c) * global_batch * c.max_target_length / devices


def step_costs(compiled, c: Config, trainer, target=None) -> dict:
    """The compute figures of the report (module docstring); None where a figure is unavailable."""
    on = platform.of_mesh(trainer.mesh)
    model = model_flops_per_device(c, trainer.global_batch, trainer.num_devices)
    out: dict = {
        "model_flops": model,
        "compiled_flops": None,
        "compiled_flops_method": None,
        "flops_ratio": None,
        "loops": [],
        "kernels": [],
        "flops_by_op_name": {},
        "newton_schulz_flops": None,  # Muon's orthogonalisation (opt_type=muon), in compiled
        "cost_analysis_flops": None,
        "roofline_seconds": None,
        "roofline_method": None,
        "mfu_bound": None,
        "peak_flops_per_s": target.chip.peak_bf16_flops if target and target.chip else None,
    }
    try:
        count = flops.count_flops(compiled.as_text())
    except Exception as e:  # noqa: BLE001 - a program text the counter cannot read
        out["compiled_flops_method"] = f"unavailable: {type(e).__name__}: {e}"[:200]
        return out
    out.update(
        compiled_flops=count.flops,
        compiled_flops_method=METHOD,
        flops_ratio=count.flops / model if model else None,
        loops=[
            {"op": x.name, "trips": x.trip_count, "where": x.op_name, "expected": x.expected}
            for x in count.loops
        ],
        kernels=[
            {
                "kernel": k.describe(),
                "rows": k.rows,
                "groups": k.groups,
                "expected_rows": k.expected_rows,
                "flops": k.flops,
                "worst_flops": k.worst_flops,
            }
            for k in count.kernels
        ],
        flops_by_op_name=dict(sorted(count.by_op_name.items(), key=lambda kv: -kv[1])[:TOP_OPS]),
        newton_schulz_flops=count.matching(muon.NS_SCOPE),
    )
    if count.expected_trip_counts:
        out["compiled_flops_method"] += (
            f"; {len(count.expected_trip_counts)} grouped-matmul tile loop(s) of data-dependent "
            "trip count at their balanced-routing count"
        )
    if count.unknown_trip_counts:
        out["compiled_flops_method"] += (
            f"; {len(count.unknown_trip_counts)} loop(s) of unknown trip count counted once"
        )
    if count.flop_free_loops:
        out["compiled_flops_method"] += (
            f"; {len(count.flop_free_loops)} data-dependent loop(s) without a matmul"
        )
    if count.opaque:
        out["compiled_flops_method"] += f"; {len(count.opaque)} kernel(s) not counted"
    out["unknown_loops"] = len(count.unknown_trip_counts)
    out["opaque_kernels"] = len(count.opaque)
    if on != "tpu":
        return out
    try:
        analysis = compiled.cost_analysis() or {}
    except Exception:  # noqa: BLE001 - not every compiler implements it
        analysis = {}
    if isinstance(analysis, list):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else {}
    out["cost_analysis_flops"] = analysis.get("flops")
    scale = count.flops / count.flops_once if count.flops_once else 1.0
    optimal = analysis.get("optimal_seconds")
    chip = target.chip if target is not None else None
    moved = analysis.get("bytes accessed")
    if optimal is not None and optimal > 0:
        out["roofline_seconds"] = optimal * scale
        out["roofline_method"] = (
            "the TPU compiler's optimal_seconds, loop bodies scaled by the trip-weighted to "
            "once-counted FLOPs ratio"
        )
    elif chip is not None and moved:
        out["roofline_seconds"] = max(
            count.flops / chip.peak_bf16_flops, moved * scale / chip.hbm_bytes_per_s
        )
        out["roofline_method"] = (
            f"max(compiled FLOPs / the chip's peak, XLA's bytes accessed x {scale:.1f} (the "
            "loop scaling of the FLOPs) / its HBM bandwidth); the compiler's own optimal_seconds "
            f"is {optimal:.3g} for this program (its data-dependent loops have no cost)"
        )
    why = _no_bound(count, model)
    if why is not None:  # the count misses work: a bound from it would be too high
        out["roofline_seconds"] = None
        out["roofline_method"] = f"no roofline: {why}"
    elif out["roofline_seconds"] and out["peak_flops_per_s"]:
        out["mfu_bound"] = model / (out["roofline_seconds"] * out["peak_flops_per_s"])
    return out


def _no_bound(count, model: float) -> str | None:
    """Why the compiled count cannot bound MFU: a loop with matmuls of unknown trip count or a
    kernel the counter cannot read (both counted short), or fewer FLOPs than the model's (the
    program computes at least what the model does, so a short count misses something)."""
    if count.unknown_trip_counts:
        return f"{len(count.unknown_trip_counts)} loop(s) with matmuls of unknown trip count"
    if count.opaque:
        names = ", ".join(sorted({t for _, t, _ in count.opaque}))
        return f"{len(count.opaque)} kernel(s) the FLOP count cannot read ({names})"
    if count.flops < model:
        return (
            f"the compiled count ({count.flops / 1e12:.1f} TFLOP) is below the model's "
            f"({model / 1e12:.1f} TFLOP): some work is not counted"
        )
    return None


def _flop(n: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} FLOP"


def format_costs(r: dict) -> list[str]:
    """The report's compute lines (none for a report without them)."""
    if r.get("model_flops") is None:
        return []
    if r.get("compiled_flops") is None:
        why = r.get("compiled_flops_method") or "not computed"
        return [
            f"compute per device and step: the model's {_flop(r['model_flops'])}; compiled: {why}"
        ]
    lines = [
        f"compute per device and step: compiled {_flop(r['compiled_flops'])} against the "
        f"model's {_flop(r['model_flops'])} ({r['flops_ratio']:.2f}x); "
        f"{r['compiled_flops_method']}",
    ]
    if r.get("roofline_seconds") is not None:
        mfu = "" if r["mfu_bound"] is None else f", bounding MFU at {100 * r['mfu_bound']:.1f}%"
        lines.append(
            f"  roofline estimate (not a measured time): {r['roofline_seconds'] * 1e3:.2f} ms per "
            f"step{mfu}; {r.get('roofline_method') or ''}"
        )
    return lines
