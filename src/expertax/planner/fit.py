"""`expertax memory --fit`: the fastest plan whose compiled step fits the device and host memory.

The candidates (`space.py`: layouts, rules, remat presets and per-name placement ladders with
host offload and the paged stash, MoE and attention token chunks, vocab tiles, attention,
moments, state offload) each get an analytic estimate by term (`estimate.py`) and a step-time
estimate (`steptime.py`).
The search then repeats, while the time budget (`minutes`) and `max_compiles` allow:
1. scale each candidate's terms by the calibration of what has been compiled (`calibrate.py`);
2. of those estimated to fit the device budget less the headroom and the host's memory (and, once
   a plan fits, estimated faster than it), compile the one with the least estimated step time;
3. record its compiled peak and host bytes, and learn from them.
A candidate that fits is the answer unless a faster one may still fit; a program the compiler
refuses for memory is a miss; any other error is shown as an error, and the search goes on.
Where the answer splits an MLA model's sequence, the other context strategy (ring or
all_gather: the same work) is compiled too, and the smaller program taken.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

from expertax import hostmem, platform, progress
from expertax.config import ConfigError
from expertax.config.schema import Config
from expertax.parallel import remat
from expertax.planner import comm, plan, steptime
from expertax.planner.calibrate import Calibration, Measured
from expertax.planner.costs import step_costs
from expertax.planner.estimate import CHUNKS_KEY
from expertax.planner.fit_table import bytes_text, seconds_text, train_line
from expertax.planner.space import Candidate, candidates, check_inputs, ring_context
from expertax.preflight import build_config
from expertax.sharding.mesh import buildable
from expertax.steptime import program
from expertax.train.trainer import build_trainer

GIB = plan.GIB
TOP = 8  # rows of the table
# How far over the target a calibrated estimate may be and still be compiled when nothing is
# estimated to fit (the estimate's error the search is built to hold: 15 %).
MARGIN = 0.15


def default_compile(c: Config, hbm_gib: float, devices=None, target=None) -> tuple[int, dict]:
    """The compiled peak bytes per device of `c` on `devices` (default: JAX's) and the figures
    of the program: {"measured": calibrate.Measured, the compute figures (planner/costs.py),
    "not_honoured": host placements the program does not hold, "refused": the compiler's
    words for a program over the chip's memory (TPU: in seconds, with the bytes its
    temporaries need; the peak is then the state plus those bytes)}."""
    trainer = build_trainer(c, devices)
    on = platform.of_mesh(trainer.mesh)
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
    predicted = program.predict(compiled.as_text(), c, trainer, target)
    if predicted is not None:
        costs["predicted"] = {
            k: predicted[k]
            for k in (
                "seconds",
                "compute_seconds",
                "exposed_communication_seconds",
                "exposed_host_seconds",
                "mfu",
                "tokens_per_s_per_device",
            )
        }
        costs["predicted_step_s"] = predicted["seconds"]
    peak, offloaded, offloaded_residuals = plan.device_peak(c, state, xla, on=on)
    args = xla["argument"] - offloaded
    measured = Measured(
        peak, args, peak - args, plan.host_bytes(xla, offloaded, offloaded_residuals)
    )
    honoured = plan.not_honoured(c, xla, on)
    # One process compiles every candidate: drop this program, JAX's caches and the free heap
    # before the next (a 671B search ran out of 24 GiB at its second compile).
    del compiled, trainer, predicted
    jax.clear_caches()
    gc.collect()
    hostmem.release_free_memory()
    return peak, {**costs, "measured": measured, "not_honoured": honoured}


def fit_search(
    c: Config,
    devices: int,
    hbm_gib: float,
    *,
    headroom: float = 10.0,
    allow_drops: bool = False,
    max_compiles: int = 12,
    minutes: float = 30.0,
    compile_fn: Callable[[Config, float], Any] | None = None,
    log=None,
    hardware=None,
    offload: bool = True,
) -> dict:
    """Search, compile the fastest that may fit, and return the `fit` report (module docstring).

    `hardware` (targets.Target, TPU or GPU): compile for its devices, search only the meshes its
    topology can lay out, estimate for its platform and chip, hold the host to its memory.
    `compile_fn(config, hbm_gib)` returns the peak bytes or (peak bytes, figures as
    `default_compile`'s). `offload=False` leaves host offload out of the space."""
    check_inputs(c, devices, hbm_gib, headroom, allow_drops)
    t0 = time.perf_counter()
    target_devices = hardware.devices() if hardware is not None else None
    if compile_fn is None:
        compile_fn = lambda cc, hbm: default_compile(cc, hbm, target_devices, hardware)
    on = hardware.platform if hardware is not None else platform.current()
    chip = hardware.chip if hardware is not None else None
    host = getattr(chip, "host", None)
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    budget = hbm_gib * GIB
    target = budget * (1 - headroom / 100)
    host_budget = host.ram_gib * GIB / host.chips if host is not None else float("inf")
    pinned = offload and remat.backend_has_pinned_host(target_devices)
    # The GPU compiler without a GPU does not place the state in pinned host memory.
    state_offload = not (on == "gpu" and hardware is not None)
    fits_topology = None
    if target_devices is not None:
        fits_topology = lambda shape: buildable(shape, target_devices)
    with platform.use(on, target_devices[0] if target_devices else None):
        pool = candidates(
            c,
            devices,
            allow_drops=allow_drops,
            pinned_host=pinned,
            state_offload=state_offload,
            buildable=fits_topology,
            on=on,
            chip=chip,
        )
    log(
        f"[fit] {len(pool)} candidates estimated in {time.perf_counter() - t0:.1f} s; target "
        f"{bytes_text(target)} ({hbm_gib:g} GiB - {headroom:g}% headroom)"
        + (
            f", host {bytes_text(host_budget)} per device ({host.ram_gib:.0f} GiB / {host.chips})"
            if host
            else ""
        )
    )
    cal = Calibration(on)
    times = steptime.Model(c, chip, devices)
    paddings: dict[tuple, float] = {}
    exchanges: dict[tuple, float] = {}

    def comm_s(x: Candidate) -> float:
        """The layout's collectives on the target's links (planner/comm.py; 0 on the CPU)."""
        shape = {a[len("ici_") : -len("_parallelism")]: v for a, v in x.overrides.items()
                 if a.startswith("ici_") and a.endswith("_parallelism")}  # fmt: skip
        key = (tuple(sorted(shape.items())), round(x.recompute_share, 2))
        if key not in exchanges:
            found = comm.estimate(c, shape, target_devices or [], hardware, x.recompute_share)
            exchanges[key] = found.seconds if found is not None else 0.0
        return exchanges[key]

    def padding(x: Candidate) -> float:
        key = (x.overrides["ici_expert_parallelism"], x.overrides.get(CHUNKS_KEY, 1))
        if key not in paddings:
            paddings[key] = steptime.grouped_padding(c, key[0], key[1], on)
        return paddings[key]

    compiled: list[Candidate] = []
    best: Candidate | None = None

    def try_one(cand: Candidate) -> bool:
        """Compile `cand`, record what it cost and learn from it; whether it fits."""
        values = {**c.model_dump(), **cand.overrides}
        if values["remat_policy"] != "custom":  # the preset places every name itself
            values.update({n: Config.model_fields[n].default for n in remat.ALL_NAMES})
        try:
            cc = build_config(values)
        except ConfigError as e:
            cand.error = f"refused: {e}"
            log(f"[fit] skip {cand.describe()}: {e}")
            return False
        n = len(compiled) + 1
        log(
            f"[fit] compile {n}: {cand.describe()} (estimate {bytes_text(cand.estimate_bytes)}, "
            f"host {bytes_text(cand.estimate_host_bytes)}, step ~{seconds_text(_seconds(cand))} s)"
            " ..."
        )
        t1 = time.perf_counter()
        try:
            result = compile_fn(cc, hbm_gib)
        except Exception as e:  # noqa: BLE001 - shown as an error, the search goes on
            cand.error = f"ERROR {type(e).__name__}: {e}".splitlines()[0][:300]
            cand.seconds = round(time.perf_counter() - t1, 1)
            compiled.append(cand)
            log(f"[fit]   {cand.error}")
            skipped = _skip_alike(pool, cand)
            if skipped:
                log(f"[fit]   skip {skipped} more candidates of the same remat and offload")
            bar.update(1)
            return False
        cand.seconds = round(time.perf_counter() - t1, 1)
        bar.update(1)
        cand.peak_device_bytes, cand.extra = result if isinstance(result, tuple) else (result, {})
        measured = cand.extra.pop("measured", None)
        cand.host_bytes = None if measured is None else measured.host
        if "refused" in cand.extra:
            cand.error = "refused by the compiler for memory"
        cal.add(cand.key, cand.terms, measured)
        planned = cand.step.model_flops + cand.step.recompute_flops if cand.step else 0
        if cand.step is not None and cand.extra.get("compiled_flops") and planned:
            # Ranked by the estimate, like every candidate not compiled; the compiled FLOPs'
            # time is reported beside it.
            cand.extra["flops_vs_plan"] = cand.extra["compiled_flops"] / planned
            compiled_step = times.compiled(cand.step, cand.extra["compiled_flops"])
            cand.extra["compiled_step_s"] = compiled_step.seconds
        compiled.append(cand)
        fits = _fits(cand, target, host_budget)
        cand.extra["over"] = not fits
        log(
            f"[fit]   peak {bytes_text(cand.peak_device_bytes)}"
            + (f", host {bytes_text(cand.host_bytes)}" if cand.host_bytes else "")
            + f" ({'fits' if fits else 'over'}; estimate {_error(cand)}) in {cand.seconds} s"
        )
        for note in cand.extra.get("not_honoured", []):
            log(f"[fit]   NOT HONOURED: {note}")
        return fits

    bar = progress.bar(min(max_compiles, len(pool)), "memory --fit", unit="candidate")
    log = progress.say_above(bar, log, file=sys.stderr)
    deadline = t0 + 60 * minutes
    stopped = "no candidate left that may fit"
    while True:
        if len(compiled) >= max_compiles:
            stopped = f"--max-compiles {max_compiles} reached"
            break
        spent = [x.seconds for x in compiled if x.seconds]
        if spent and time.perf_counter() + sum(spent) / len(spent) > deadline:
            stopped = f"--fit-minutes {minutes:g} would be passed by one more compile"
            break
        scale = _time_scale(compiled)
        cand = _next(pool, cal, times, target, host_budget, best, padding, scale, comm_s)
        if cand is None:
            break
        if try_one(cand) and (best is None or _seconds(cand) < _seconds(best)):
            best = cand
    other = _strategy_sibling(best, c)
    if best is not None and other is not None and len(compiled) < max_compiles + 1:
        spent = [x.seconds for x in compiled if x.seconds]
        if not spent or time.perf_counter() + sum(spent) / len(spent) <= deadline:
            # equal speed (the same work and bytes moved): keep the smaller compiled program
            pool.append(other)
            if try_one(other) and (other.peak_device_bytes or 0) < (best.peak_device_bytes or 0):
                log(f"[fit] {other.layout} compiled smaller than {best.layout}: taken")
                best = other
    bar.close()
    return _report(
        c,
        pool,
        compiled,
        best,
        cal,
        hardware,
        on,
        devices,
        hbm_gib,
        headroom,
        target,
        host_budget,
        t0,
        stopped,
    )


def _strategy_sibling(best: Candidate | None, c: Config) -> Candidate | None:
    """`best` with the other `context_parallel_strategy` (ring <-> all_gather) where it splits
    an MLA model's sequence, not compiled yet (None otherwise). The two do the same work and move
    about the same bytes, and the estimate cannot tell which program is smaller: the ring holds
    two shares of the latent instead of the whole sequence's, but its per-token buffers outweigh
    that at few context devices (docs/design/context.md). So the search compiles both."""
    if best is None or best.overrides.get("ici_context_parallelism", 1) == 1:
        return None
    if not ring_context(c, best.overrides.get("attention_impl", c.attention_impl)):
        return None
    ring = best.overrides.get("context_parallel_strategy") == "ring"
    other = "all_gather" if ring else "ring"
    return dataclasses.replace(
        best,
        overrides={**best.overrides, "context_parallel_strategy": other},
        peak_device_bytes=None, host_bytes=None, seconds=None, error="", extra={},
    )  # fmt: skip


def _next(
    pool, cal, times, target, host_budget, best, padding, scale=1.0, comm_s=lambda x: 0.0
) -> Candidate | None:
    """The uncompiled candidate with the least estimated step time among those the calibrated
    estimate says fit (and beat `best`: its estimate times `scale`, the compiled programs'
    predicted to estimated time, against `best`'s predicted); when none does before anything
    compiled, the one of least estimated bytes (to learn from)."""
    live = []
    ratios: dict[tuple, dict[str, float]] = {}
    misses = _compiled(pool)
    for x in pool:
        if x.peak_device_bytes is not None or x.error:
            continue
        r = ratios.get(x.key)
        if r is None:
            r = ratios[x.key] = cal.ratios(x.key)
        x.estimate_bytes = x.terms.peak(r)
        x.estimate_host_bytes = x.terms.host(r)
        x.step = times.of(
            x.recompute_share, x.terms, r.get("host", 1.0), padding(x), comm_s=comm_s(x),
            overrides=x.overrides,
        )  # fmt: skip
        if x.estimate_bytes <= target and x.estimate_host_bytes <= host_budget:
            faster = best is None or x.step.seconds * scale < _seconds(best)
            if faster and not _like_a_miss(x, misses):
                live.append(x)
    if live:
        return min(live, key=_rank)
    if best is not None:
        return None
    # Nothing is estimated to fit: the least estimate, while the estimate's uncertainty leaves
    # it a chance (before any compile, whatever it is: the search learns from it).
    rest = [x for x in pool if x.peak_device_bytes is None and not x.error]
    nearest = min(rest, key=lambda x: x.estimate_bytes, default=None)
    if nearest is None or (cal.compiled and nearest.estimate_bytes > target * (1 + MARGIN)):
        return None
    return nearest


def _skip_alike(pool: list[Candidate], failed: Candidate) -> int:
    """Mark the uncompiled candidates of `failed`'s remat choice and host offload as skipped
    (how many): a compiler error other than a refusal for memory comes from the program's
    structure, which those choices make (XLA:GPU's layout assignment failing on a host-offloaded
    residual, say); other layouts and chunkings of it fail alike, and would spend the compile
    budget on nothing."""
    n = 0
    for x in pool:
        alike = x.remat_label == failed.remat_label and x.offload == failed.offload
        if alike and x is not failed and x.peak_device_bytes is None and not x.error:
            x.error = f"skipped: {failed.describe()} failed to compile"
            n += 1
    return n


def _compiled(pool: list[Candidate]) -> list[Candidate]:
    return [x for x in pool if x.peak_device_bytes is not None and not x.error]


def _like_a_miss(x: Candidate, compiled: list[Candidate]) -> bool:
    """Whether the estimate cannot tell `x` from a compiled miss of the same layout, remat
    choice and host offload (within 2 %): levers it sees as no change (moments or vocab tiles
    when they are not at the peak) are not compiled again."""
    return any(
        y.extra.get("over")
        and y.layout == x.layout
        and y.remat_label == x.remat_label
        and y.offload == x.offload
        and abs(x.estimate_bytes - (y.peak_device_bytes or 0)) <= 0.02 * (y.peak_device_bytes or 0)
        for y in compiled
    )


def _rank(x: Candidate) -> tuple[float, float, int]:
    """Least estimated step time first; among equal ones, fewer collective bytes, then fewer
    estimated bytes."""
    assert x.step is not None
    return (x.step.seconds, x.step.exchange_bytes, x.estimate_bytes)


def _seconds(x: Candidate) -> float:
    """A compiled candidate's step time predicted from its program (steptime/, on a TPU or GPU
    target: compute, exposed collectives and host transfers), else its estimate."""
    predicted = x.extra.get("predicted_step_s")
    if predicted:
        return predicted
    return x.step.seconds if x.step is not None else float("inf")


def _time_scale(compiled: list[Candidate]) -> float:
    """The median of predicted / estimated step time over the compiled candidates that have
    both (1 without any): what the estimate, blind to collectives, misses."""
    ratios = sorted(
        x.extra["predicted_step_s"] / x.step.seconds
        for x in compiled
        if x.extra.get("predicted_step_s") and x.step is not None and x.step.seconds
    )
    return ratios[len(ratios) // 2] if ratios else 1.0


def _fits(x: Candidate, target: float, host_budget: float) -> bool:
    if x.peak_device_bytes is None or x.error:
        return False
    return x.peak_device_bytes <= target and (x.host_bytes or 0) <= host_budget


def _error(x: Candidate) -> str:
    if not x.peak_device_bytes:
        return "-"
    off = x.estimate_bytes / x.peak_device_bytes - 1
    return f"{bytes_text(x.estimate_bytes)}, {100 * off:+.1f}%"


def _report(
    c,
    pool,
    compiled,
    best,
    cal,
    hardware,
    on,
    devices,
    hbm_gib,
    headroom,
    target,
    host_budget,
    t0,
    stopped,
) -> dict:
    budget = hbm_gib * GIB
    rest = sorted(
        (
            x
            for x in pool
            if x.peak_device_bytes is None
            and not x.error
            and x.step is not None
            and x.estimate_bytes <= target
            and x.estimate_host_bytes <= host_budget
        ),
        key=_rank,
    )
    fitting = sorted((x for x in compiled if _fits(x, target, host_budget)), key=_seconds)
    shown = (
        fitting + [x for x in compiled if x not in fitting] + rest[: max(0, TOP - len(compiled))]
    )
    closest = best or min(
        (x for x in compiled if x.peak_device_bytes),
        key=lambda x: x.peak_device_bytes,
        default=None,
    )
    host = getattr(getattr(hardware, "chip", None), "host", None)
    return {
        "target": hardware.spec if hardware is not None else on,
        "devices": devices,
        "hbm_gib": hbm_gib,
        "headroom_percent": headroom,
        "target_bytes": int(target),
        "host_budget_bytes": None if host is None else int(host_budget),
        "host": None
        if host is None
        else {
            "chips": host.chips,
            "ram_gib": host.ram_gib,
            "link": host.link,
            "link_bytes_per_s": host.link_bytes_per_s,
            "source": host.source,
        },
        "searched": len(pool),
        "compiled": len(compiled),
        "errors": [x.describe() + ": " + x.error for x in compiled if x.error.startswith("ERROR")],
        "stopped": stopped,
        "seconds": round(time.perf_counter() - t0, 1),
        "calibration": cal.ratios(best.key if best else None),
        "assumed_mfu": steptime.ASSUMED_MFU,
        "time_scale": _time_scale(compiled),
        "candidates": [x.as_json(budget, target) for x in shown],
        "best": _best_json(closest, target, budget),
        "fits": best is not None,
        "train_line": train_line(c, best.overrides) if best else None,
    }


def _best_json(cand: Candidate | None, target: float, budget: float) -> dict | None:
    if cand is None:
        return None
    peak = cand.peak_device_bytes
    return {
        **cand.as_json(budget, target),
        **{k: v for k, v in cand.extra.items() if k != "refused"},
        "fits": peak is not None and peak <= target,
        "over_bytes": None if peak is None else max(0, int(peak - target)),
    }
