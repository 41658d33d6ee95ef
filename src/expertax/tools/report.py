"""`expertax report RUN_DIR`: PNG plots and an index.html of a run folder, from its files alone.

Reads `metrics.jsonl` and `config.yml` only (nothing from jax: a run folder copied to a machine
without accelerators renders the same). Plots, in `RUN_DIR/report` unless told otherwise:

    loss.png                    train loss per step, eval loss at the evaluated steps
    expert_load_heatmap.png     load / mean load, MoE layers x experts, at the last logged step
    expert_load_layer<i>.png    load / mean load of layer i, logged steps x experts (--layer)
    expert_load_balance.png     max / mean load and experts without tokens, per layer, over steps
    throughput.png              step time and tokens/s/device per step
    index.html                  the plots, the run's summary and its config

The per-layer loads are the `expert_load` lists that training writes at log_period.
"""

from __future__ import annotations

import html
import json
import statistics
from pathlib import Path

import numpy as np
import yaml
from matplotlib.figure import Figure

from expertax import jsonio, paths
from expertax.errors import ConfigError
from expertax.train import config_file
from expertax.train.metrics import expert_load_summary

METRICS_FILE = "metrics.jsonl"  # the names train/run_dir.py writes (not imported: it needs jax)
CONFIG_FILE = "config.yml"
REPORT_SUBDIR = "report"
# What make_report writes in its folder: each plot by name, and the page showing them.
PLOT_FILES = {
    "loss": "loss.png",
    "throughput": "throughput.png",
    "expert_load_heatmap": "expert_load_heatmap.png",
    "expert_load_layer": "expert_load_layer{layer}.png",
    "expert_load_balance": "expert_load_balance.png",
}
INDEX_FILE = "index.html"


def report_files(layer: int) -> list[str]:
    """The names of the files `make_report(..., layer=layer)` may write in its folder."""
    return [name.format(layer=layer) for name in PLOT_FILES.values()] + [INDEX_FILE]


def read_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    """(config values, metrics records) of a run folder; ConfigError when it is not one."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"RUN_DIR={str(run_dir)!r} is not a directory")
    missing = [f for f in (METRICS_FILE, CONFIG_FILE) if not (path / f).is_file()]
    if missing:
        raise ConfigError(
            f"RUN_DIR={str(run_dir)!r} is not an expertax run folder: no {' and no '.join(missing)}"
            " (a run folder is <base_output_directory>/<run_name>, written by `expertax train`)"
        )
    config = config_file.read_saved(
        path / CONFIG_FILE, "the report reads the run's settings from it: restore it from a copy"
    )
    records = []
    metrics = paths.read_text(
        f"RUN_DIR={str(run_dir)!r}: {METRICS_FILE}",
        path / METRICS_FILE,
        "it is damaged; restore it from a copy",
    )
    for line in metrics.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a record cut off by a crash
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            records.append(rec)
    if not records:
        raise ConfigError(f"RUN_DIR={str(run_dir)!r}: {METRICS_FILE} holds no step records yet")
    return config, records


def _numeric(value) -> bool:
    """A number of a metrics record: a JSON number, or null (a value that was not finite)."""
    return value is None or isinstance(value, int | float)


def _number(record: dict, key: str) -> float | None:
    """`record[key]` as a float, a null (not finite) as NaN; None when the record lacks `key`."""
    return jsonio.number(record[key]) if key in record and _numeric(record[key]) else None


def _series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records holding `key`; a non-finite value is NaN (a gap drawn)."""
    rows = [(r["step"], _number(r, key)) for r in records if key in r and _numeric(r[key])]
    steps, values = zip(*rows) if rows else ((), ())
    return np.asarray(steps), np.asarray(values, np.float64)


def _ratio_LE(load_LE) -> np.ndarray:
    """Load / mean load per layer (1 = balanced)."""
    load = np.asarray(load_LE, np.float64)
    mean = load.mean(-1, keepdims=True)
    return np.divide(load, mean, out=np.zeros_like(load), where=mean > 0)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_loss(records: list[dict], path: Path) -> Path:
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(*_series(records, "loss"), label="train loss", lw=1.2)
    steps, values = _series(records, "eval_loss")
    if len(steps):
        ax.plot(steps, values, "o-", label="eval loss", color="tab:red", ms=4)
    steps, values = _series(records, "mtp_loss")
    if len(steps):  # multi-token prediction (models/mtp.py): the mean over depths
        ax.plot(steps, values, label="train MTP loss", color="tab:green", lw=1.0)
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title="loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _edges(centers) -> np.ndarray:
    """Cell edges around increasing `centers` (midpoints; half a unit beyond the ends)."""
    c = np.asarray(centers, np.float64)
    mid = (c[1:] + c[:-1]) / 2
    return np.concatenate([[c[0] - 0.5], mid, [c[-1] + 0.5]])


def _heatmap(fig: Figure, data: np.ndarray, xlabel: str, ylabel: str, title: str, rows=None):
    """A [rows, experts] heatmap; `rows`: the y value of each row (default 0..n-1), cells sized
    by the gaps between them (logged steps need not be evenly spaced)."""
    ax = fig.add_subplot()
    rows = np.arange(data.shape[0]) if rows is None else rows
    x = _edges(np.arange(data.shape[1]))
    image = ax.pcolormesh(x, _edges(rows), data, cmap="viridis")
    ax.invert_yaxis()
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    fig.colorbar(image, ax=ax, label="load / mean load")
    return ax


def plot_load_heatmap(step: int, load_LE, path: Path) -> Path:
    ratio = _ratio_LE(load_LE)
    layers, experts = ratio.shape
    fig = Figure(figsize=(max(5.0, 0.25 * experts + 2), max(2.5, 0.35 * layers + 1.5)))
    ax = _heatmap(fig, ratio, "expert", "MoE layer", f"expert load at step {step}")
    ax.set_yticks(range(layers))
    return _save(fig, path)


def plot_layer_over_time(logged: list[dict], layer: int, path: Path) -> Path:
    steps = [r["step"] for r in logged]
    ratio = np.stack([_ratio_LE(r["expert_load"])[layer] for r in logged])  # [logged, E]
    experts = ratio.shape[1]
    fig = Figure(figsize=(max(5.0, 0.25 * experts + 2), 4.5))
    _heatmap(fig, ratio, "expert", "step", f"expert load of MoE layer {layer} over steps", steps)
    return _save(fig, path)


def plot_load_balance(logged: list[dict], path: Path) -> Path:
    steps = [r["step"] for r in logged]
    per_step = [[expert_load_summary(e) for e in r["expert_load"]] for r in logged]
    fig = Figure(figsize=(7, 6))
    top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    for layer in range(len(per_step[0])):
        top.plot(steps, [s[layer]["max_over_mean"] for s in per_step], label=f"layer {layer}")
        zeros = [s[layer]["experts_without_tokens"] for s in per_step]
        bottom.plot(steps, zeros, label=f"layer {layer}")
    top.set(ylabel="max / mean load", title="expert load balance per MoE layer")
    bottom.set(xlabel="step", ylabel="experts without tokens")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", ncol=2)
    return _save(fig, path)


def plot_throughput(records: list[dict], path: Path) -> Path:
    fig = Figure(figsize=(7, 6))
    top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    top.plot(*_series(records, "step_time_s"), color="tab:blue")
    top.set(ylabel="step time (s)", title="speed")
    bottom.plot(*_series(records, "tokens_per_s_per_device"), color="tab:green")
    bottom.set(xlabel="step", ylabel="tokens / s / device")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def summarize(config: dict, records: list[dict]) -> dict:
    """The run's headline numbers (the first two steps, with compilation, left out of speeds)."""
    steady = records[2:] or records
    summary = {
        "run_name": config.get("run_name"),
        "model_name": config.get("model_name"),
        "steps recorded": len(records),
        "last step": records[-1]["step"],
        "steps planned": config.get("steps"),
        "first loss": _number(records[0], "loss"),
        "final loss": _number(records[-1], "loss"),
        "median step time (s)": statistics.median(r["step_time_s"] for r in steady),
        "median tokens/s/device": statistics.median(r["tokens_per_s_per_device"] for r in steady),
    }
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        summary["final eval loss"] = _number(evals[-1], "eval_loss")
        summary["final eval perplexity"] = _number(evals[-1], "eval_perplexity")
        if "eval_mtp_acceptance" in evals[-1]:
            summary["final eval MTP loss"] = _number(evals[-1], "eval_mtp_loss")
            summary["final eval MTP acceptance"] = _number(evals[-1], "eval_mtp_acceptance")
    if "mtp_loss" in records[-1]:
        summary["final MTP loss"] = _number(records[-1], "mtp_loss")
    return summary


def make_report(run_dir: str | Path, out_dir: str | Path | None = None, layer: int = 0) -> dict:
    """Render every plot and index.html; returns {"out_dir", "plots": {name: path}, "summary"}."""
    config, records = read_run(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / REPORT_SUBDIR
    logged = [r for r in records if r.get("expert_load")]
    if logged and not 0 <= layer < len(logged[-1]["expert_load"]):
        raise ConfigError(
            f"--layer={layer}: the run has {len(logged[-1]['expert_load'])} MoE layers; "
            f"use 0..{len(logged[-1]['expert_load']) - 1}"
        )
    out.mkdir(parents=True, exist_ok=True)
    file = {name: out / f.format(layer=layer) for name, f in PLOT_FILES.items()}
    plots = {
        "loss": plot_loss(records, file["loss"]),
        "throughput": plot_throughput(records, file["throughput"]),
    }
    if logged:
        last = logged[-1]
        heatmap = file["expert_load_heatmap"]
        plots["expert_load_heatmap"] = plot_load_heatmap(last["step"], last["expert_load"], heatmap)
        over_time = file["expert_load_layer"]
        plots["expert_load_layer"] = plot_layer_over_time(logged, layer, over_time)
        balance = file["expert_load_balance"]
        plots["expert_load_balance"] = plot_load_balance(logged, balance)
    summary = summarize(config, records)
    (out / INDEX_FILE).write_text(_index_html(run_dir, plots, summary, config, bool(logged)))
    return {"out_dir": out, "plots": plots, "summary": summary}


def _index_html(run_dir, plots: dict, summary: dict, config: dict, has_loads: bool) -> str:
    esc = html.escape
    rows = "".join(
        f"<tr><th>{esc(k)}</th><td>{esc(f'{v:.6g}' if isinstance(v, float) else str(v))}</td></tr>"
        for k, v in summary.items()
    )
    images = "".join(
        f'<figure><img src="{esc(p.name)}" alt="{esc(name)}"><figcaption>{esc(name)}'
        "</figcaption></figure>"
        for name, p in plots.items()
    )
    note = "" if has_loads else "<p>No per-layer expert loads in this run (a dense model).</p>"
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>expertax report: {esc(str(run_dir))}</title><style>"
        "body{font-family:sans-serif;margin:2em}img{max-width:100%}"
        "figure{display:inline-block;margin:1em;vertical-align:top}"
        "th{text-align:left;padding-right:1em}pre{background:#f4f4f4;padding:1em}</style>"
        f"</head><body><h1>expertax run {esc(str(run_dir))}</h1><h2>Summary</h2>"
        f"<table>{rows}</table>{note}<h2>Plots</h2>{images}<h2>Config</h2>"
        f"<pre>{esc(yaml.safe_dump(config, sort_keys=False))}</pre></body></html>\n"
    )
