"""The table of `expertax parity`: one markdown row per layout (trained, refused or skipped),
and the JSON report (`--json`)."""

from __future__ import annotations

from expertax import jsonio
from expertax.tools.parity import routing
from expertax.tools.parity.layouts import parse_layout

HEADER = (
    "mode",
    "ring",
    "a2a",
    "PP",
    "CP",
    "EP",
    "FSDP",
    "TP",
    "data",
    "stash",
    "rules",
    "final loss",
    "perplexity",
    "tok/s/dev",
    "max |dloss|",
    "routing flips",
    "imposed |dloss|",
    "ok",
)


def pp_cell(pp: int, microbatches: int, repeats: int) -> str:
    """The PP column: the stages, with the microbatches and repeats when not the defaults."""
    extra = ([f"mb{microbatches}"] if microbatches != pp else []) + (
        [f"r{repeats}"] if repeats != 1 else []
    )
    return " ".join([str(pp), *extra])


def cp_cell(cp: int, balance: bool, ring: bool = False) -> str:
    """The CP column: the context axis, `nolb` when its load balancing is off, `ring` under
    context_parallel_strategy=ring."""
    if cp == 1:
        return "1"
    return " ".join([str(cp)] + (["nolb"] if not balance else []) + (["ring"] if ring else []))


def format_row(r: dict, tol: float, ref_losses: list[float]) -> str:
    _, ok = routing.verdict(r, tol * max(abs(x) for x in ref_losses))
    imposed = r.get("imposed_loss_diff")
    pp = r.get("pp", 1)  # rows written before pipeline layouts have no pp
    cells = (
        r["mode"],
        str(r["ring"]),
        r["a2a_impl"],
        pp_cell(pp, r.get("microbatches", pp), r.get("repeats", 1)),
        cp_cell(r.get("cp", 1), r.get("load_balance", True), r.get("cp_ring", False)),
        r["ep"],
        r["fsdp"],
        r["tp"],
        r["data"],
        "yes" if r.get("stash") else "no",
        r.get("sharding_rules", "default"),
        f"{r['final_loss']:.6f}",
        f"{r['perplexity']:.3f}",
        "-" if r["tokens_per_s_per_device"] is None else f"{r['tokens_per_s_per_device']:,.0f}",
        f"{r['max_abs_loss_diff']:.2e}",
        routing.format_flips(r.get("routing_flips")),
        "-" if imposed is None else f"{imposed:.2e}",
        ok,
    )
    return "| " + " | ".join(str(x) for x in cells) + " |"


def format_refused_row(refused: dict, skipped: bool, why: str = "refused") -> str:
    """A refused (or skipped) layout's row: its name in the first cells, the reason in the last."""
    layout = parse_layout(refused["layout"])
    pp = pp_cell(layout.pp, layout.pipeline_microbatches, layout.repeats)
    cp = cp_cell(layout.cp, layout.balance, layout.cp_ring)
    cells = [layout.mode, str(layout.ring), layout.a2a_impl, pp, cp, layout.ep, layout.fsdp]
    cells += [layout.tp, layout.data, "yes" if layout.stash else "no", layout.rules]
    cells += ["-"] * 6
    word = "skipped" if skipped else "NO"
    cells.append(f"{word} ({why}: {refused['reason'].replace('|', '/')})")
    return "| " + " | ".join(str(x) for x in cells) + " |"


def format_table(result: dict) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in result["rows"]:
        lines.append(format_row(r, result["tolerance"], result["reference_losses"]))
    for r in result.get("refused", []):
        lines.append(format_refused_row(r, result.get("skip_refused", False)))
    for r in result.get("skipped", []):
        lines.append(format_refused_row(r, True, why="model"))
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    keep = ("rows", "refused", "skipped", "skip_refused", "tolerance", "ok")
    with open(path, "w") as f:
        jsonio.dump({k: result[k] for k in keep if k in result}, f, indent=1)
