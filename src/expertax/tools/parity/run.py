"""`expertax parity`: the same model, weights and data under many layouts, one loss table.

Every layout (layouts.py) trains from the same initial weights (initialization does not depend
on the sharding) on the same synthetic batches, and its per-step losses are compared with the
single-device reference run. A layout fails when max_step |loss - reference| exceeds
`TOLERANCE[dtype]` x |reference|. A layout the config checks refuse (an expert axis that does not
divide num_experts, more devices than visible, ...) fails the table too, with its reason in its
row, unless refusals are asked to be skipped (`expertax parity --skip-refused`): then it is listed
as skipped and not counted.

Each row also counts its routing flips (routing.py): per MoE layer, the (token, slot) decisions
of the first step whose expert differs from the reference's, a top-k near-tie that a layout's
rounding tipped the other way. With `impose_routing` (`--impose-routing`) the first step's loss
is also compared with the reference's routing imposed on the layout. A row out of tolerance
passes only when flips explain it: it flips, and with the routing imposed its loss is within
tolerance (`routing.verdict`).

With multi-token prediction (`mtp_num_layers` > 0) the compared loss is the objective's
cross-entropy part, the main loss + mtp_loss_scaling_factor x the MTP loss, so that the MTP
modules' forward is held to the reference as well as the training it drives.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np

from expertax import platform, progress
from expertax.config.schema import Config
from expertax.data.synthetic import SyntheticData
from expertax.errors import ConfigError
from expertax.tools.parity import routing as parity_routing
from expertax.tools.parity.layouts import (
    Layout,
    default_layouts,
    layout_config,
    pipeline_misfit,
    reference_layout,
)
from expertax.tools.parity.table import format_row
from expertax.train.trainer import build_trainer

# Relative tolerance on the loss, per compute dtype (the one table; loosening it is reviewed).
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 1e-2}


def refusal(base: Config, layout: Layout, global_batch: int, devices=None) -> str | None:
    """Why the config checks refuse `layout` on `devices` (default: this process's) (config and
    mesh, nothing compiled), or None."""
    devices = list(jax.devices() if devices is None else devices)
    try:
        c = layout_config(base, layout, global_batch)
        build_trainer(c, devices=devices[: layout.num_devices])
    except ConfigError as e:
        return str(e)
    return None


def run_layout(
    base: Config,
    layout: Layout,
    *,
    steps: int,
    global_batch: int,
    corrupt: Callable | None = None,
    routing: list | None = None,
    packed: bool = False,
) -> dict:
    """Train `steps` steps of `base` under `layout`; per-step losses and throughput.

    `corrupt(state, trainer) -> state` is a test hook applied to the initial state (the negative
    control: a deliberately mis-sharded weight must fail the table).
    `routing`: the routings to probe the first batch with (parity_routing.probe: None for the
    routers' own, an array to impose), when the layout can be probed; their results in "probes".
    """
    c = layout_config(base, layout, global_batch)
    devices = jax.devices()[: layout.num_devices]
    data = SyntheticData(
        vocab_size=c.vocab_size,
        seq_len=c.max_target_length,
        global_batch=global_batch,
        seed=c.data_shuffle_seed,
    )
    batches = [data.batch_at(i) for i in range(steps)]
    if packed:
        batches = [pack(b, i) for i, b in enumerate(batches)]
    probes = None
    if routing and corrupt is None and parity_routing.probed(c):
        probes = parity_routing.probe(c, devices, batches[0], routing)
    trainer = build_trainer(c, devices=devices)
    state = trainer.init_state()
    step_fn = trainer.compile()
    if corrupt is not None:
        state = corrupt(state, trainer)
    losses = []

    def loss(m):  # the main loss, plus the weighted MTP loss with MTP (module docstring)
        return (
            m["loss"] + c.mtp_loss_scaling_factor * m["mtp_loss"] if "mtp_loss" in m else m["loss"]
        )

    with trainer.context():
        state, m = step_fn(state, trainer.put_batch(batches[0]))  # warm-up, not timed
        losses.append(loss(m))
        jax.block_until_ready(m)
        t0 = time.perf_counter()
        for batch in batches[1:]:
            state, m = step_fn(state, trainer.put_batch(batch))
            losses.append(loss(m))
        jax.block_until_ready(losses)
        dt = time.perf_counter() - t0
    tokens = global_batch * c.max_target_length * (steps - 1)
    return {
        "losses": [float(x) for x in jax.device_get(losses)],
        # None with one step: it is the untimed warm-up
        "tokens_per_s_per_device": tokens / dt / trainer.num_devices if steps > 1 else None,
        "probes": probes,
    }


def pack(batch: dict, step: int) -> dict:
    """`batch` as packed data: each row cut into up to three documents at random points (seeded
    by `step`), positions from 0 per document, no target across a document's end."""
    rng = np.random.default_rng(step)
    b, t = batch["inputs"].shape
    out = dict(batch)
    seg, pos, w = (np.empty((b, t), np.int32) for _ in range(3))
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=min(2, t - 1), replace=False))
        seg[r] = 1 + np.searchsorted(cuts, np.arange(t), side="right")
        starts = np.concatenate([[0], cuts])[seg[r] - 1]
        pos[r] = np.arange(t) - starts
        w[r] = np.append(seg[r, 1:] == seg[r, :-1], True)
    out.update(segment_ids=seg, positions=pos, weights=batch["weights"] * w)
    return out


def make_row(layout: Layout, run: dict, ref_losses: list[float], ref_probe: dict | None = None):
    """The row of `layout`; with the reference's probe (`ref_probe`, {"loss", "chosen"}) and the
    layout's probes (run["probes"]: its own routing, then the imposed one if any), its routing
    flips per MoE layer and the first step's |dloss| under the imposed routing."""
    diff = max(abs(a - b) for a, b in zip(run["losses"], ref_losses, strict=True))
    final = run["losses"][-1]
    probes = run.get("probes")
    flips = imposed = None
    if probes and ref_probe is not None:
        flips = parity_routing.count_flips(ref_probe["chosen"], probes[0]["chosen"])
        if len(probes) > 1:
            imposed = abs(probes[1]["loss"] - ref_probe["loss"])
    return {
        "mode": layout.mode,
        "ring": layout.ring,
        "a2a_impl": layout.a2a_impl,
        "pp": layout.pp,
        "cp": layout.cp,
        "load_balance": layout.balance,
        "cp_ring": layout.cp_ring,
        "microbatches": layout.pipeline_microbatches,
        "repeats": layout.repeats,
        "ep": layout.ep,
        "fsdp": layout.fsdp,
        "tp": layout.tp,
        "data": layout.data,
        "stash": layout.stash,
        "sharding_rules": layout.rules,
        "final_loss": final,
        "perplexity": float(np.exp(min(final, 80.0))),
        "tokens_per_s_per_device": run["tokens_per_s_per_device"],
        "max_abs_loss_diff": diff,
        "routing_flips": flips,
        "imposed_loss_diff": imposed,
    }


def parity_table(
    base: Config,
    *,
    steps: int,
    layout_list: list[Layout] | None = None,
    skip_refused: bool = False,
    corrupt: dict | None = None,
    echo=print,
    impose_routing: bool = False,
    packed: bool = False,
) -> dict:
    """Run the reference and every layout.

    Returns {"rows", "refused", "skipped", "skip_refused", "tolerance", "reference_losses",
    "ok"}: `rows` for the layouts that trained, `refused` ({"layout", "reason"}) for those the
    config checks refused, `skipped` (the same fields) for the default matrix's pipeline layouts
    that `base`'s layers do not divide into (`pipeline_misfit`; never counted against `ok`).
    `ok` needs every row's `parity_routing.verdict` and, unless `skip_refused`, no refusal.
    A table where no layout trained is not ok (it compared nothing).
    Each layout the routing probe can run (parity_routing.probed; none with a `corrupt` hook) is
    probed on the first batch: its routing flips against the reference's; with `impose_routing`
    also its first-step loss under the reference's routing.
    `corrupt` maps a Layout to a `corrupt(state, trainer)` hook (tests only).
    """
    n = len(jax.devices())
    skipped = []
    if layout_list is None:
        layout_list = []
        for layout in default_layouts(n, platform.of_devices(jax.devices())):
            misfit = pipeline_misfit(base, layout)
            if misfit is None:
                layout_list.append(layout)
            else:
                skipped.append({"layout": layout.name, "reason": misfit})
                echo(f"skipped {layout.name}: {misfit}")
    global_batch = int(base.per_device_batch_size * n)
    tol = TOLERANCE[base.dtype]
    refused, runnable = [], []
    for layout in layout_list:  # refusals first: they cost no compile
        reason = refusal(base, layout, global_batch)
        if reason is None:
            runnable.append(layout)
        else:
            refused.append({"layout": layout.name, "reason": reason})
            echo(f"{'skipped' if skip_refused else 'REFUSED'} {layout.name}: {reason}")
    rows, ref_losses = [], []
    bar = progress.bar(len(runnable) + 1 if runnable else 0, "parity", unit="layout")
    say = progress.say_above(bar, echo)
    probe = any(
        parity_routing.probed(layout_config(base, layout, global_batch))
        and layout not in (corrupt or {})
        for layout in runnable
    )
    ref_probe = None
    if runnable:
        bar.set_postfix_str("reference")
        ref = run_layout(
            base,
            reference_layout(),
            steps=steps,
            global_batch=global_batch,
            routing=[None] if probe else None,
            packed=packed,
        )
        ref_losses, ref_probe = ref["losses"], (ref.get("probes") or [None])[0]
        bar.update(1)
        say(f"reference (1 device): final loss {ref_losses[-1]:.6f} after {steps} steps")
    for layout in runnable:
        bar.set_postfix_str(layout.name)
        hook = (corrupt or {}).get(layout)
        routing = None
        if ref_probe is not None:
            routing = [None, ref_probe["chosen"]] if impose_routing else [None]
        run = run_layout(
            base, layout, steps=steps, global_batch=global_batch, corrupt=hook, routing=routing,
            packed=packed,
        )  # fmt: skip
        rows.append(make_row(layout, run, ref_losses, ref_probe))
        bar.update(1)
        say(format_row(rows[-1], tol, ref_losses))
    bar.close()
    bound = tol * max((abs(x) for x in ref_losses), default=0.0)
    ok = all(parity_routing.verdict(r, bound)[0] for r in rows) and (skip_refused or not refused)
    ok = ok and bool(rows)
    return {
        "rows": rows,
        "refused": refused,
        "skipped": skipped,
        "skip_refused": skip_refused,
        "tolerance": tol,
        "reference_losses": ref_losses,
        "ok": ok,
    }
