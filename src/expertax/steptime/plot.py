"""The predicted timeline of one layer: the body of the program's heaviest loop (the scanned
layers' forward or backward pass), with the compute stream, the link stream and the host link
as lanes, collectives as blocks, and the compute stream's waits for them marked as exposed."""

from __future__ import annotations

from expertax.steptime.simulate import LANES, Simulator

LABELS = ("compute", "link", "host link", "SparseCore")
COLORS = {"compute": "#4C72B0", "host": "#8172B2", "core": "#8C8C8C", "exposed": "#C44E52"}
KIND_COLORS = {
    "all-gather": "#55A868",
    "reduce-scatter": "#DD8452",
    "all-reduce": "#937860",
    "all-to-all": "#DA8BC3",
    "ragged-all-to-all": "#CCB974",
    "collective-permute": "#64B5CD",
}


def heaviest_loop(sim: Simulator):
    loops = [lp for lp in sim.loops if lp.body in sim.memo]
    return max(loops, key=lambda lp: lp.body_seconds * lp.trips, default=None)


def waits(events) -> list[tuple[float, float]]:
    """Gaps on the compute lane that a collective covers: the compute stream waiting."""
    busy = sorted((s, e) for lane, s, e, _ in events if lane == "compute")
    links = [(s, e) for lane, s, e, _ in events if lane == "link"]
    out, t = [], 0.0
    for s, e in busy + [(float("inf"), float("inf"))]:
        if s > t:
            for ls, le in links:
                lo, hi = max(t, ls), min(s, le)
                if hi > lo:
                    out.append((lo, hi))
        t = max(t, e)
    return out


def write(sim: Simulator, path: str, title: str) -> str | None:
    """Write the plot (the format from the file's suffix); the loop plotted, or None."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loop = heaviest_loop(sim)
    seg = sim.memo[loop.body] if loop else sim.memo[sim.m.entry]
    events = seg.events
    fig, ax = plt.subplots(figsize=(12, 3))
    for lane, start, end, label in events:
        y = LANES.index(lane)
        color = KIND_COLORS.get(label, COLORS.get(lane, "#999999"))
        ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (y - 0.4, 0.8), color=color)
    for lo, hi in waits(events):
        ax.broken_barh([(lo * 1e3, (hi - lo) * 1e3)], (-0.4, 0.8), color=COLORS["exposed"],
                       hatch="//", alpha=0.6)  # fmt: skip
    ax.set_yticks(range(len(LANES)), LABELS)
    ax.set_xlabel("ms (predicted from the compiled program, not measured)")
    what = f"one trip of {loop.op_name or loop.name} (x{loop.trips:g})" if loop else "the step"
    ax.set_title(f"{title}: {what}", fontsize=9)
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c) for c in (*KIND_COLORS.values(), COLORS["exposed"])
    ]
    ax.legend(handles, [*KIND_COLORS, "exposed (compute waits)"], fontsize=7, ncol=4,
              loc="upper right")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return loop.name if loop else None
