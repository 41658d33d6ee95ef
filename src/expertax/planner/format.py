"""The memory plan as text (`format_report`) and as JSON-ready data (`to_json_ready`)."""

from __future__ import annotations

import jax
import jax.extend
import numpy as np

from expertax.planner import pipeline as memory_pipeline
from expertax.planner.costs import format_costs
from expertax.planner.plan import GIB
from expertax.steptime.report import format_steptime


def _fmt(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _on(r: dict) -> str:
    if r.get("target", "cpu") == r.get("backend"):
        return f"{r['devices']} {r['backend']} devices"
    return r["target_description"]


def format_refused(r: dict) -> str:
    """A program the compiler refused for memory: the "does not fit" row."""
    need = r["peak_device_bytes"]
    return "\n".join(
        [
            f"expertax memory: {r['model_name']} on {_on(r)}, mesh {r['mesh']}",
            f"  parameters {_fmt(r['parameter_bytes'])}, optimizer state "
            f"{_fmt(r['optimizer_state_bytes'])} per device",
            f"the compiler refused the program: {r['refused']}",
            "DOES NOT FIT"
            + (
                ""
                if need is None
                else f": at least {_fmt(need)} per device (state + the "
                "temporaries the compiler asked for)"
            )
            + ("" if r["hbm_gib"] is None else f" of {r['hbm_gib']:g} GiB"),
        ]
    )


def format_report(r: dict) -> str:
    """The human-readable report."""
    if r.get("refused"):
        return format_refused(r)
    lines = [
        f"expertax memory: {r['model_name']} on {_on(r)}, "
        f"mesh {r['mesh']}, batch {r['global_batch']} ({r['batch_per_device']} per device) x "
        f"{r['max_target_length']}, remat_policy={r['remat_policy']}",
        "per device:",
        f"  parameters       {_fmt(r['parameter_bytes']):>12}"
        + ("  (pinned host)" if r["parameter_memory_host_offload"] else "")
        + (
            f"  (ideal: all parameters / {r['devices']} devices = "
            f"{_fmt(r['ideal_parameter_bytes'])})"
            if "ideal_parameter_bytes" in r
            else ""
        ),
        f"  optimizer state  {_fmt(r['optimizer_state_bytes']):>12}"
        + ("  (pinned host)" if r["optimizer_memory_host_offload"] else ""),
        f"  gradients        {_fmt(r['gradient_bytes']):>12}",
    ]
    if r.get("pipeline"):
        lines += memory_pipeline.format_pipeline(r["pipeline"], _fmt)
    for stack, names in r.get("names_kept", {}).items():
        lines.append(f"checkpoint names a {stack} layer can keep: {', '.join(names)}")
    lines += [f"placed but not saved: {why}" for why in r.get("names_not_saved", {}).values()]
    lines.append("saved residuals per layer (name, shape, bytes, placement, x layers = total):")
    for res in r["residuals"]:
        shape = "x".join(map(str, res["shape"])) or "scalar"
        lines.append(
            f"  [{res['stack']:5}] {res['name']:<22} {res['dtype']:>8}[{shape}] "
            f"{_fmt(res['bytes']):>11} {res['placement']:<6} x {res['layers']} = "
            f"{_fmt(res['total_bytes'])}"
        )
    lines.append(
        f"  total residuals: {_fmt(r['residual_bytes_device'])} device, "
        f"{_fmt(r['residual_bytes_host'])} host"
    )
    if r.get("stash"):
        lines.append(_format_stash(r["stash"]))
    ws = r["float32_weight_sum"]
    lines.append(
        f"float32_weight_sum={str(ws['enabled']).lower()}: "
        f"{_fmt(ws['extra_bytes_if_enabled'])} of float32 combine temporaries per MoE layer"
        + ("" if ws["enabled"] else " (saved: off)")
    )
    x = r["xla"]
    lines += [
        "XLA (compiled train step, per device):",
        f"  arguments {_fmt(x['argument'])}, outputs {_fmt(x['output'])}, aliased "
        f"{_fmt(x['alias'])}, temporaries {_fmt(x['temp'])}",
        f"  host: arguments {_fmt(x['host_argument'])}, outputs {_fmt(x['host_output'])}, "
        f"temporaries {_fmt(x['host_temp'])}",
        "  peak estimate (arguments + outputs - aliased + temporaries"
        + (
            f" - {_fmt(r['offloaded_state_bytes'])} offloaded state"
            if r["offloaded_state_bytes"]
            else ""
        )
        + (
            f" - {_fmt(r['offloaded_residual_bytes'])} offloaded residuals"
            if r.get("offloaded_residual_bytes")
            else ""
        )
        + f"): {_fmt(r['peak_device_bytes'])}",
    ]
    if r["offloaded_state_bytes"] or r.get("offloaded_residual_bytes"):
        lines.append(
            "  (XLA:CPU has one memory and counts pinned-host bytes as device bytes; the "
            "estimate takes out what this config places on host)"
        )
    lines += [f"  NOT HONOURED: {n}" for n in r.get("not_honoured", [])]
    if r.get("host_bytes_per_host") is not None:
        lines.append(
            f"  pinned host per host: {_fmt(r['host_bytes_per_host'])} of "
            f"{_fmt(r['host_ram_bytes'])} ({'fits' if r['host_fits'] else 'DOES NOT FIT'}); "
            f"link {r['host_link']}"
        )
    lines += format_costs(r)
    if r.get("step_time"):
        lines += format_steptime(r["step_time"]).splitlines()
    lines += _format_top_buffers(r)
    lines += [f"note: {n}" for n in r.get("plan_notes", [])]
    if r["hbm_gib"] is not None:
        verdict = "FITS" if r["fits"] and r.get("host_fits", True) else "DOES NOT FIT"
        lines.append(
            f"{verdict}: {_fmt(r['peak_device_bytes'])} of {r['hbm_gib']:g} GiB per device "
            f"({100 * r['peak_device_bytes'] / (r['hbm_gib'] * GIB):.1f}%)"
        )
    return "\n".join(lines)


def _format_stash(s: dict) -> str:
    ratio = lambda a, b: f"{a / b:.2f}" if b else "-"
    return (
        f"paged stash ({', '.join(s['names'])}; {s['capacity_rows']} + {s['page_rows']} rows, "
        f"factor {s['capacity_factor']:g}): buffer {_fmt(s['buffer_bytes'])}, routed rows "
        f"{_fmt(s['routed_bytes'])}, worst case without the stash {_fmt(s['worst_case_bytes'])} "
        f"(buffer / routed {ratio(s['buffer_bytes'], s['routed_bytes'])}, worst case / buffer "
        f"{ratio(s['worst_case_bytes'], s['buffer_bytes'])})"
    )


def _format_top_buffers(r: dict) -> list[str]:
    a = r.get("attribution", {"unavailable": "not computed"})
    if a.get("unavailable"):
        return [f"attribution unavailable: {a['unavailable']}"]
    lines = [
        f"largest buffers alive at XLA's peak (schedule step {a['peak_step']}, "
        f"{a['peak_instruction'] or '?'}; {a['peak_buffers']} buffers, "
        f"{_fmt(a['peak_live_bytes'])} in all):",
        f"  {'bytes':>11}  {'dtype[shape]':<26} {'HLO instruction':<34} "
        f"{'source (src/expertax)':<28} name / note",
    ]
    for b in r["top_buffers"]:
        shape = f"{b['dtype']}[{','.join(map(str, b['shape']))}]"
        extra = "; ".join(
            x for x in (b["name"], b["note"], "host" if b["placement"] == "host" else "") if x
        )
        extra = extra if len(extra) <= 80 else extra[:77] + "..."
        if b.get("why"):  # no source line in our code: why, in full, on the next line
            extra += f"\n{'':>13}no source: {b['why']}"
        lines.append(
            f"  {_fmt(b['bytes']):>11}  {shape:<26} {b['op']:<34} {b['source'] or '-':<28} {extra}"
        )
    return lines


def to_json_ready(r: dict) -> dict:
    """The report with numpy scalars turned into Python numbers."""
    return jax.tree.map(lambda v: v.item() if isinstance(v, np.generic) else v, r)
