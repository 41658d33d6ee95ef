"""`expertax memory --fit`: find a layout, remat and offload under which the train step fits.

The candidates (`space.py`) each get an analytic estimate (`estimate.py`), only for ranking and
pruning. Candidates whose estimate meets the budget with the requested headroom are ranked by what
they cost (drops, then offload, then bfloat16 moments, then recompute share, rules, chunks, tiles)
and then by estimate, and compiled AOT best-first (`plan.device_peak` of the compiled step); the
search stops at the first whose compiled peak fits with the headroom. After each compile the
remaining estimates are rescaled by the smallest compiled/estimated ratio seen and pruned again.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from expertax import platform, progress
from expertax.config import ConfigError, build_config, load_config
from expertax.config.schema import Config
from expertax.parallel import remat
from expertax.planner import plan
from expertax.planner.costs import format_costs, step_costs
from expertax.planner.estimate import CHUNKS_KEY
from expertax.planner.space import Candidate, candidates, check_inputs
from expertax.sharding.mesh import buildable
from expertax.train.trainer import build_trainer

GIB = plan.GIB


def _like_a_miss(x: Candidate, compiled: list[Candidate], target: float) -> bool:
    """Whether the estimate cannot tell `x` from a compiled candidate of the same layout that
    missed the target (within 1%): levers the estimate sees as no change (e.g. vocab tiles when
    the logits are not at the peak) are not compiled again."""
    return any(
        y.peak_device_bytes is not None
        and y.peak_device_bytes > target
        and y.layout == x.layout
        and abs(x.estimate_bytes - y.estimate_bytes) <= 0.01 * y.estimate_bytes
        for y in compiled
    )


def default_compile(c: Config, hbm_gib: float, devices=None, target=None) -> tuple[int, dict]:
    """The compiled peak bytes per device of `c` on `devices` (default: JAX's): plan's figure
    (arguments + outputs - aliased + temporaries, offloaded state taken out once where the
    compiler counts pinned host with the device), without its residual trace; and the step's
    compute figures (planner/costs.py). A program the compiler refuses for memory (TPU: in
    seconds, with the bytes its temporaries need) comes back as state + those bytes."""
    trainer = build_trainer(c, devices)
    remat.check_offload_supported(remat.config_placements(c), list(trainer.mesh.devices.flat))
    state = trainer.abstract_state()
    try:
        compiled = trainer.compile()
    except Exception as e:
        why = plan.refused_for_memory(e)
        if why is None:
            raise
        peak = plan.refused_peak(why, state)
        return (peak if peak is not None else int(hbm_gib * GIB) + 1), {"refused": why}
    xla = plan.xla_figures(compiled)
    costs = step_costs(compiled, c, trainer, target)
    costs.pop("loops", None)
    return plan.device_peak(c, state, xla)[0], costs


def fit_search(
    c: Config,
    devices: int,
    hbm_gib: float,
    *,
    headroom: float = 10.0,
    allow_drops: bool = False,
    max_compiles: int = 12,
    compile_fn: Callable[[Config, float], Any] | None = None,
    log=None,
    hardware=None,
    offload: bool = True,
) -> dict:
    """Search, compile best-first, and return the `fit` report (see the module docstring).

    `hardware` (targets.Target, TPU or GPU): compile for its devices, search only the meshes its
    topology can lay out, and estimate for its platform. `compile_fn` returns the peak bytes or
    (peak bytes, extra figures for the report). `offload=False` leaves host offload out."""
    check_inputs(c, devices, hbm_gib, headroom, allow_drops)
    target_devices = hardware.devices() if hardware is not None else None
    if compile_fn is None:
        compile_fn = lambda cc, hbm: default_compile(cc, hbm, target_devices, hardware)
    on = hardware.platform if hardware is not None else platform.current()
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    budget = hbm_gib * GIB
    target = budget * (1 - headroom / 100)
    t0 = time.perf_counter()
    pinned = offload and remat.backend_has_pinned_host(target_devices)
    fits_topology = None
    if target_devices is not None:
        fits_topology = lambda shape: buildable(shape, target_devices)
    with platform.use(on, target_devices[0] if target_devices else None):
        pool = candidates(
            c, devices, allow_drops=allow_drops, pinned_host=pinned, buildable=fits_topology
        )
    log(
        f"[fit] {len(pool)} candidates estimated in {time.perf_counter() - t0:.1f} s; "
        f"target {_b(target)} ({hbm_gib:g} GiB - {headroom:g}% headroom)"
    )
    ratio, ratios = 1.0, []
    compiled: list[Candidate] = []
    tried = set()
    best = None
    bar = progress.bar(min(max_compiles, len(pool)), "memory --fit", unit="candidate")
    log = progress.say_above(bar, log, file=sys.stderr)
    while len(compiled) < max_compiles:
        live = [
            x
            for x in pool
            if id(x) not in tried
            and x.estimate_bytes * ratio <= target
            and not _like_a_miss(x, compiled, target)
        ]
        if not live:
            if compiled:
                break
            live = [x for x in pool if id(x) not in tried]  # nothing passes: try the nearest
            live.sort(key=lambda x: x.estimate_bytes)
            live = live[:1]
            if not live:
                break
        else:
            live.sort(key=lambda x: (x.cost, x.estimate_bytes))
        cand = live[0]
        tried.add(id(cand))
        values = {**c.model_dump(), **cand.overrides}
        if values["remat_policy"] != "custom":  # the preset places every name itself
            values.update({n: Config.model_fields[n].default for n in remat.ALL_NAMES})
        try:
            cc = build_config(values)
        except ConfigError as e:
            cand.error = str(e)
            log(f"[fit] skip {cand.describe()}: {e}")
            continue
        n = len(compiled) + 1
        log(
            f"[fit] compile {n}/{max_compiles}: {cand.describe()} "
            f"(estimate {_b(ratio * cand.estimate_bytes)}) ..."
        )
        t1 = time.perf_counter()
        try:
            result = compile_fn(cc, hbm_gib)
            cand.peak_device_bytes, cand.extra = (
                result if isinstance(result, tuple) else (result, {})
            )
            if "refused" in cand.extra:
                cand.error = "refused by the compiler for memory"
        except Exception as e:  # noqa: BLE001 - a candidate XLA cannot compile is skipped
            cand.error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            log(f"[fit]   failed: {cand.error}")
            continue
        finally:
            cand.seconds = round(time.perf_counter() - t1, 1)
            bar.update(1)
        compiled.append(cand)
        fits = cand.peak_device_bytes <= target
        log(
            f"[fit]   peak {_b(cand.peak_device_bytes)} "
            f"({'fits' if fits else 'over'}) in {cand.seconds} s"
        )
        if cand.estimate_bytes:  # rescale by the most optimistic compiled/estimated ratio yet
            ratios.append(cand.peak_device_bytes / cand.estimate_bytes)
            ratio = min(max(min(ratios), 0.5), 4.0)
        if fits:
            best = cand
            break
    bar.close()
    closest = best or min(compiled, key=lambda x: x.peak_device_bytes or 0, default=None)
    ranked = (
        compiled
        + sorted(
            (x for x in pool if x.peak_device_bytes is None and x.estimate_bytes <= target),
            key=lambda x: (x.cost, x.estimate_bytes),
        )[: max(0, 12 - len(compiled))]
    )
    return {
        "target": hardware.spec if hardware is not None else on,
        "devices": devices,
        "hbm_gib": hbm_gib,
        "headroom_percent": headroom,
        "target_bytes": int(target),
        "searched": len(pool),
        "compiled": len(compiled),
        "seconds": round(time.perf_counter() - t0, 1),
        "candidates": [x.as_json(budget, target) for x in ranked],
        "best": _best_json(best or closest, target),
        "fits": best is not None,
        "train_line": train_line(c, best.overrides) if best else None,
    }


def _best_json(cand: Candidate | None, target: float) -> dict | None:
    if cand is None:
        return None
    peak = cand.peak_device_bytes
    return {
        "overrides": dict(cand.overrides),
        "peak_device_bytes": peak,
        **{k: v for k, v in cand.extra.items() if k != "refused"},
        "fits": peak is not None and peak <= target,
        "over_bytes": None if peak is None else max(0, int(peak - target)),
    }


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
    head = (
        f"{'#':>2} {'layout':<16} {'remat':<19} {'offload':<10} {'chunks':>6} {'tiles':>5} "
        f"{'peak ' + unit:>9} {'headroom':>8} {'recompute':>9} {'est ' + unit:>8}"
    )
    lines = [
        f"expertax memory --fit: {r.get('target', 'cpu')}, {r['devices']} devices x "
        f"{r['hbm_gib']:g} GiB, headroom "
        f"{r['headroom_percent']:g}% (target {_b(r['target_bytes'])}); "
        f"{r['searched']} candidates estimated, {r['compiled']} compiled in {r['seconds']} s",
        head,
    ]
    for i, x in enumerate(r["candidates"], 1):
        o = x["overrides"]
        peak = x["peak_device_bytes"]
        extra = " ".join(
            f"{k}={o[k]}" for k in ("attention_impl", "mu_dtype", "ragged_buffer_factor") if k in o
        )
        peak_s = "-" if peak is None else f"{peak / size:.2f}"
        room_s = "-" if peak is None else f"{x['headroom_percent']:.1f}%"
        lines.append(
            f"{i:>2} {x['layout']:<16} {x['remat_policy']:<19} {x['offload']:<10} "
            f"{o.get(CHUNKS_KEY, 1):>6} {o['num_vocab_tiling']:>5} "
            f"{peak_s:>9} {room_s:>8} "
            f"{100 * x['recompute_share']:>8.1f}% {x['estimate_bytes'] / size:>8.2f}"
            + (f"  {extra}" if extra else "")
            + (f"  ({x['error']})" if x["error"] else "")
        )
    b = r["best"]
    if r["fits"]:
        lines.append(
            f"FITS: {b['peak_device_bytes'] / size:.2f} {unit} of {r['hbm_gib']:g} GiB per device"
        )
        if b.get("compiled_flops") is not None:
            lines += format_costs(b)
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


def _b(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 1024**2:.2f} MiB"


def _describe_overrides(o: dict) -> str:
    return " ".join(f"{k}={_fmt_value(v)}" for k, v in o.items())
