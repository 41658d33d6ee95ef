"""The text of `expertax memory --fit`: the ranked table of candidates, the verdict and the
train line of the answer (`format_fit`), from the result `fit.fit_search` returns."""

from __future__ import annotations

from typing import Any

from expertax.config.schema import Config
from expertax.planner.costs import format_costs
from expertax.planner.estimate import ATT_CHUNKS_KEY, CHUNKS_KEY
from expertax.planner.plan import GIB
from expertax.preflight import load_config


def train_line(c: Config, overrides: dict[str, Any]) -> str:
    """`expertax train model_name=... key=value ...` with every key that differs from the model
    preset (the user's own overrides and the candidate's)."""
    chosen = {**c.model_dump(), **overrides}
    preset = load_config(overrides={"model_name": c.model_name}).model_dump()
    keys = [k for k in Config.model_fields if k != "model_name" and chosen[k] != preset.get(k)]
    keys += [k for k in overrides if k not in keys and k in Config.model_fields]
    items = [f"model_name={c.model_name}"] + [f"{k}={_fmt_value(chosen[k])}" for k in keys]
    return "expertax train " + " ".join(items)


def _fmt_value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def format_fit(r: dict) -> str:
    """The ranked table, then the verdict and the train line."""
    unit, size = ("GiB", GIB) if r["hbm_gib"] >= 4 else ("MiB", 1024**2)
    host = r.get("host")
    lines = [
        f"expertax memory --fit: {r.get('target', 'cpu')}, {r['devices']} devices x "
        f"{r['hbm_gib']:g} GiB, headroom {r['headroom_percent']:g}% (target "
        f"{bytes_text(r['target_bytes'])})"
        + (
            f"; host {host['ram_gib']:.0f} GiB per {host['chips']} chips, link {host['link']} "
            f"{host['link_bytes_per_s'] / 1e9:g} GB/s"
            if host
            else ""
        )
        + f"; {r['searched']} candidates estimated, {r['compiled']} compiled in {r['seconds']} s "
        f"({r['stopped']})",
        f"{'#':>2} {'layout':<16} {'remat':<24} {'offload':<10} {'chunks m/a':>10} {'tiles':>5} "
        f"{'est ' + unit:>8} {'peak ' + unit:>9} {'est err':>7} {'headroom':>8} "
        f"{'host/host':>9} {'recomp':>6} {'xfer s':>6} {'step s':>7} {'pred s':>7}",
    ]
    chips = host["chips"] if host else 1
    for i, x in enumerate(r["candidates"], 1):
        lines.append(f"{i:>2} " + _row(x, size, chips))
    lines.append(
        "step s: estimated, not measured: (model + recompute FLOPs) at "
        f"{100 * r['assumed_mfu']:.0f}% of the chip's peak, activation transfers overlapped, "
        "state transfers not; the layout's collectives on the target's links counted exposed "
        "(planner/comm.py), and what MoE token chunks re-read of the experts' weights and re-add "
        "of their gradients in HBM beyond the routed matmuls. pred s: the compiled program's step "
        "time predicted on the target (compute, exposed collectives and host transfers: "
        "docs/steptime.md), not measured; the ranking's figure where present. host/host: pinned "
        "host bytes per host. chunks m/a: MoE / attention token chunks."
    )
    for e in r.get("errors", []):
        lines.append(f"ERROR: {e}")
    b = r["best"]
    if r["fits"]:
        lines.append(
            f"FITS: {b['peak_device_bytes'] / size:.2f} {unit} of {r['hbm_gib']:g} GiB per device "
            f"({b['headroom_percent']:.1f}% free), {b['remat']}"
        )
        if b.get("compiled_flops") is not None:
            lines += format_costs(b)
        if b.get("predicted"):
            p = b["predicted"]
            lines.append(
                f"  step time predicted from the compiled program, not measured: "
                f"{_dur(p['seconds'])} (compute {_dur(p['compute_seconds'])}, "
                f"exposed communication {_dur(p['exposed_communication_seconds'])}, "
                f"exposed host {_dur(p['exposed_host_seconds'])}); MFU "
                f"{100 * (p['mfu'] or 0):.1f}%, {p['tokens_per_s_per_device'] or 0:,.0f} tokens/s "
                "per chip"
            )
        if b.get("flops_vs_plan"):
            lines.append(
                f"  compiled FLOPs / (the model's + the plan's recompute): {b['flops_vs_plan']:.2f}"
                f"; step at the compiled FLOPs (estimate, not measured): "
                f"{b['compiled_step_s']:.2f} s"
            )
        lines.append(r["train_line"])
    elif b is not None and b["peak_device_bytes"] is not None:
        lines.append(
            f"NO CANDIDATE FITS: the closest compiled, {_describe_overrides(b['overrides'])}, "
            f"peaks at {b['peak_device_bytes'] / size:.2f} {unit}, {b['over_bytes'] / size:.2f} "
            f"{unit} over the {r['target_bytes'] / size:.2f} {unit} target"
        )
    else:
        lines.append("NO CANDIDATE FITS: none compiled")
    return "\n".join(lines)


def _row(x: dict, size: float, chips: int) -> str:
    o, peak, step = x["overrides"], x["peak_device_bytes"], x["step"] or {}
    host_b = x["host_bytes"] if x["host_bytes"] is not None else x["estimate_host_bytes"]
    keys = ("attention_impl", "mu_dtype", "ragged_buffer_factor")
    extra = " ".join(f"{k}={o[k]}" for k in keys if k in o)
    xfer = (step.get("activation_transfer_s") or 0) + (step.get("state_transfer_s") or 0)
    peak_s = "-" if peak is None else f"{peak / size:.2f}"
    err = x["estimate_error"]
    err_s = "-" if err is None else f"{100 * err:+.1f}%"
    room_s = "-" if peak is None else f"{x['headroom_percent']:.1f}%"
    chunks = f"{o.get(CHUNKS_KEY, 1)}/{o.get(ATT_CHUNKS_KEY, 1)}"
    return (
        f"{x['layout']:<16} {x['remat']:<24} {x['offload']:<10} "
        f"{chunks:>10} {o['num_vocab_tiling']:>5} "
        f"{x['estimate_bytes'] / size:>8.2f} {peak_s:>9} {err_s:>7} {room_s:>8} "
        f"{host_b * chips / GIB:>8.1f}G {100 * x['recompute_share']:>5.0f}% "
        f"{seconds_text(xfer):>6} {seconds_text(step.get('seconds', 0)):>7} "
        f"{seconds_text(x['predicted_step_s']) if x.get('predicted_step_s') else '-':>7}"
        + (f"  {extra}" if extra else "")
        + (f"  ({x['error']})" if x["error"] else "")
    )


def seconds_text(s: float) -> str:
    """Seconds, or milliseconds below a tenth of a second."""
    return f"{s:.2f}" if s >= 0.1 else f"{1e3 * s:.1f}ms"


def _dur(s: float) -> str:
    return f"{s:.2f} s" if s >= 0.1 else f"{1e3 * s:.2f} ms"


def bytes_text(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 1024**2:.2f} MiB"


def _describe_overrides(o: dict) -> str:
    return " ".join(f"{k}={_fmt_value(v)}" for k, v in o.items())
