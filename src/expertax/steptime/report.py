"""`estimate`: the step time of one compiled program on one placement, as a JSON-ready report,
and `format_steptime`, its table.

The parts add up to the step: compute (matmul-bound and memory-bound operations), exposed
communication (per collective kind and mesh axes), exposed host transfers; `seconds` is the
compute stream's wall time, so `seconds = compute + exposed communication + exposed host`
(`beside_seconds`: the TPU SparseCore's own work, beside the stream, not in the sum).
Pipeline bubbles are in the program: a stage's iterations on a microbatch it does not hold are
loop trips that compute. `bubble_seconds` is their share of the step (the pipeline loop's body
time x its S - 1 idle iterations, read from the loop's `idle~N` scope), inside the parts above.
"""

from __future__ import annotations

from expertax.planner.hlo import parse_hlo
from expertax.steptime.simulate import Simulator
from expertax.steptime.topology import Placement

METHOD = "predicted from the compiled program, not measured"


def estimate(
    hlo_text: str,
    placement: Placement,
    *,
    host_bytes_per_s: float = 0.0,
    model_flops: float | None = None,  # per device and step, for MFU
    tokens: float | None = None,  # per device and step, for tokens/s
    target: str = "",
) -> dict:
    module = parse_hlo(hlo_text)
    sim = Simulator(module, placement, host_bytes_per_s)
    seg = sim.run(module.entry)
    links = placement.links
    comm = sorted(seg.comm.values(), key=lambda c: -c.exposed_seconds)
    exposed = sum(c.exposed_seconds for c in comm)
    out = {
        "method": METHOD,
        "target": target,
        "placement": placement.source,
        "devices": placement.num_devices,
        "seconds": seg.seconds,
        "compute_seconds": seg.matmul_seconds + seg.memory_seconds,
        "matmul_seconds": seg.matmul_seconds,
        "memory_bound_seconds": seg.memory_seconds,
        "exposed_communication_seconds": exposed,
        "communication_seconds": sum(c.seconds for c in comm),
        "host_transfer_seconds": seg.host_seconds,
        "exposed_host_seconds": seg.host_exposed_seconds,
        "beside_seconds": seg.beside_seconds,
        "bubble_seconds": seg.bubble_seconds,
        "flops": seg.flops,
        "communication": [
            {
                "kind": c.kind,
                "mesh_axes": list(c.mesh_axes),
                "span": c.span,
                "count": c.count,
                "bytes": c.bytes,
                "seconds": c.seconds,
                "exposed_seconds": c.exposed_seconds,
            }
            for c in comm
        ],
        "gemms": [
            {"kernel": k, "dtypes": d, "count": n, "flops": f, "seconds": sec}
            for (k, d), (n, f, sec) in sorted(seg.gemms.items(), key=lambda kv: -kv[1][1])
        ],
        "loops": [
            {
                "op": lp.name,
                "trips": lp.trips,
                "how": lp.how,
                "body_seconds": lp.body_seconds,
                "where": lp.op_name,
            }
            for lp in sim.loops
        ],
        "untimed": sorted(set(sim.untimed)),
        "peak_flops_per_s": links.peak,
        "constants": {
            "chip": links.chip,
            "matmul_share": links.matmul_share,
            "memory_share": links.memory_share,
            "link_share": links.link_share,
            "sources": list(links.sources),
        },
        "model_flops": model_flops,
        "mfu": None,
        "tokens_per_s_per_device": None,
    }
    if model_flops and seg.seconds:
        out["mfu"] = model_flops / (seg.seconds * links.peak)
    if tokens and seg.seconds:
        out["tokens_per_s_per_device"] = tokens / seg.seconds
    out["_simulator"] = sim  # for the plot; dropped from JSON
    return out


def json_ready(report: dict) -> dict:
    return {k: v for k, v in report.items() if not k.startswith("_")}


def _ms(s: float) -> str:
    return f"{s * 1e3:,.3f} ms"


def format_steptime(r: dict) -> str:
    lines = [
        f"step time ({r['method']}): {_ms(r['seconds'])} on {r['target'] or 'the target'}",
        f"  compute           {_ms(r['compute_seconds'])}"
        f"  (matmul-bound {_ms(r['matmul_seconds'])}, memory-bound "
        f"{_ms(r['memory_bound_seconds'])})",
        f"  communication     {_ms(r['exposed_communication_seconds'])} exposed of "
        f"{_ms(r['communication_seconds'])}",
        f"  host transfers    {_ms(r['exposed_host_seconds'])} exposed of "
        f"{_ms(r['host_transfer_seconds'])}",
    ]
    if r.get("bubble_seconds"):
        lines.append(
            f"  pipeline bubble   {_ms(r['bubble_seconds'])} (each stage's idle iterations, "
            "inside the parts above)"
        )
    if r.get("mfu") is not None:
        lines.append(f"  predicted MFU     {r['mfu']:.1%} of {r['peak_flops_per_s'] / 1e12:g} TF/s")
    if r.get("tokens_per_s_per_device") is not None:
        lines.append(f"  tokens/s/device   {r['tokens_per_s_per_device']:,.0f}")
    if r["communication"]:
        lines.append("  collectives (per step; exposed first):")
        lines.append(
            f"    {'kind':<19} {'mesh axes':<16} {'spans':<24} {'count':>7} {'MB':>10}"
            f" {'seconds':>12} {'exposed':>12}"
        )
        for c in r["communication"][:12]:
            lines.append(
                f"    {c['kind']:<19} {','.join(c['mesh_axes']) or '-':<16} {c['span']:<24}"
                f" {c['count']:>7g} {c['bytes'] / 1e6:>10,.1f} {_ms(c['seconds']):>12}"
                f" {_ms(c['exposed_seconds']):>12}"
            )
    if r.get("gemms"):
        total = sum(g["flops"] for g in r["gemms"]) or 1
        lines.append("  matmuls by kernel and dtype (per step):")
        for g in r["gemms"][:10]:
            lines.append(
                f"    {g['kernel'][:44]:<44} {g['dtypes']:<22} x{g['count']:<7g} "
                f"{g['flops'] / 1e12:>9.3f} TFLOP ({g['flops'] / total:>4.0%}) "
                f"{_ms(g['seconds']):>12}"
            )
    unknown = [lp for lp in r["loops"] if lp["how"] != "read"]
    if unknown:
        lines.append(
            f"  {len(unknown)} loop(s) of data-dependent count: "
            + ", ".join(f"{lp['op']} x{lp['trips']:g} ({lp['how']})" for lp in unknown[:4])
        )
    for u in r["untimed"][:4]:
        lines.append(f"  not timed: {u}")
    lines.append(f"  placement: {r['placement']}")
    return "\n".join(lines)
