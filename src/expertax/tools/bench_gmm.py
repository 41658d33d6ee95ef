"""`expertax bench gmm`: grouped-matmul backends against a dense matmul and a roofline.

For every backend, experts E, rows N, (D, F), routing (balanced, Zipf-skewed, all rows in one
group) and pass (fwd, fwd_bwd) it reports the median time, the GFLOP/s on routed FLOPs (2·N·D·F
forward, 3x that forward+backward), the ratio to a dense `[N, D] x [D, F]` matmul of the same FLOPs
(timed interleaved with the row's own calls, so both see the same machine load), and the roofline:
routed FLOPs at the dense rate, or the bytes of expert weights that must move (read once forward;
read again and the gradient written in the backward) at the copy bandwidth measured in the same
run, whichever is longer. Rows of the default backend are labelled `auto`. Combinations whose
predicted time per call exceeds `--max-call-s` are skipped and listed with a note.

Run: `expertax bench gmm [--json PATH] [--quick]` or `python -m expertax.tools.bench_gmm`.
With `--target tpu:...|gpu:...` the backends are compiled for that target instead, nothing timed
(`bench_gmm_target.py`). Bad flag values exit with status 2 and one line naming the flag, like
config errors.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from expertax import jsonio, progress
from expertax import platform as platform_lib
from expertax.config import ConfigError
from expertax.nn.moe import gmm as gmm_lib
from expertax.outputs import add_overwrite_flag, check_apart, check_file
from expertax.tools.flags import choices, gmm_backends, positive_ints, saved_json, unread_with

GROUPINGS = ("balanced", "zipf", "one")
PASSES = ("fwd", "fwd_bwd")
BYTES_F32 = 4


def group_sizes(kind: str, experts: int, rows: int) -> np.ndarray:
    """Rows per expert summing to `rows`: equal, Zipf(1.1) over experts, or all in one expert."""
    if kind == "balanced":
        sizes = np.full(experts, rows // experts)
        sizes[: rows % experts] += 1
    elif kind == "zipf":
        p = 1.0 / np.arange(1, experts + 1) ** 1.1
        sizes = np.floor(p / p.sum() * rows).astype(np.int64)
        sizes[0] += rows - sizes.sum()
    elif kind == "one":
        sizes = np.zeros(experts, np.int64)
        sizes[experts // 2] = rows
    else:
        raise ValueError(f"groups={kind!r}; valid: {', '.join(GROUPINGS)}")
    return sizes.astype(np.int32)


def median_seconds(fn, args, repeats: int) -> float:
    """Median wall seconds of one `fn(*args)` call over `repeats`, after a warm-up call."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth_gbps(mib: int = 256, repeats: int = 5) -> tuple[float, float]:
    """(in-place, fresh-output) streaming rates in GB/s, counting bytes read + written.

    In place: `a * c` into the donated input buffer, the machine's memory bandwidth. Fresh output:
    the same into a newly allocated buffer, which XLA:CPU does for every output of every call (the
    first touch of new pages costs far more than the bandwidth on some machines).
    """
    a = jnp.ones((mib * 2**20 // BYTES_F32,), jnp.float32)
    nbytes = 2 * a.nbytes
    fresh = median_seconds(jax.jit(lambda x: x * 1.0001), (a,), repeats)
    scale = jax.jit(lambda x: x * 1.0001, donate_argnums=0)
    a = scale(a)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a = jax.block_until_ready(scale(a))
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9, nbytes / fresh / 1e9


def _pass_fn(matmul, pass_name: str):
    if pass_name == "fwd":
        return jax.jit(matmul)

    def fwd_bwd(x, w, sizes, cot):
        out, vjp = jax.vjp(lambda x_, w_: matmul(x_, w_, sizes), x, w)
        return out, *vjp(cot)

    return jax.jit(fwd_bwd)


def _median_pair_s(fn, args, ref, ref_args, repeats: int) -> tuple[float, float]:
    """Medians of `fn` and `ref`, called alternately (machine load changes under a shared CPU)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(ref(*ref_args))
    times: list[float] = []
    ref_times: list[float] = []
    for _ in range(repeats):
        for f, a, out in ((fn, args, times), (ref, ref_args, ref_times)):
            start = time.perf_counter()
            jax.block_until_ready(f(*a))
            out.append(time.perf_counter() - start)
    return statistics.median(times), statistics.median(ref_times)


def _dense_fn(pass_name: str):
    return _pass_fn(lambda x_, w_, _s: x_ @ w_, pass_name)


def _predicted_s(backend: str, experts: int, flops: float, dense_gflops: float) -> float | None:
    """Predicted seconds per call for backends whose cost grows with E, else None (never skip).

    ragged_dot on CPU/GPU expands to a dense matmul over every expert (issue #5).
    """
    if backend == "ragged_dot" and jax.default_backend() != "tpu":
        return experts * flops / (dense_gflops * 1e9)
    return None


# The text and path flags' kinds (cli/flags.py TEXT_KINDS: what each takes and must refuse).
KINDS = {
    "--json": "output file",
    "--markdown": "output file",
    "--from-json": "input json",
    "--backends": "gmm backends",
    "--experts": "positive ints",
    "--rows": "positive ints",
    "--shapes": "shapes",
    "--groups": "choice list",
    "--passes": "choice list",
}
# The flags that say what to measure: read only when measuring (refused with --from-json).
MEASURING: tuple[str, ...] = ("--quick", "--backends", "--experts", "--rows", "--shapes")
MEASURING += ("--groups", "--passes", "--repeats", "--max-call-s")
ROW_KEYS = ("backend", "impl", "experts", "rows", "d", "f", "groups", "pass", "ms", "gflops")
MACHINE_KEYS = ("copy_gbps", "fresh_copy_gbps")


def read_saved(path: str) -> tuple[list[dict], dict]:
    """(rows, machine) of a `--json` file this benchmark wrote; ConfigError naming `--from-json`
    and what is wrong with the file."""
    keys = {"rows": ROW_KEYS, "machine": MACHINE_KEYS}
    saved = saved_json("--from-json", path, keys, "give a file a --json run wrote")
    return saved["rows"], saved["machine"]


def check_args(args) -> None:
    """Every grid flag parsed before anything is measured; ConfigError names the bad flag."""
    # on the platform the grid will run on, read without starting a backend where JAX can tell
    gmm_backends("--backends", args.backends, gmm_lib.BACKENDS[1:], platform_lib.planned())
    choices("--groups", args.groups, GROUPINGS)
    choices("--passes", args.passes, PASSES)
    positive_ints("--experts", args.experts)
    positive_ints("--rows", args.rows)
    for shape in args.shapes.split(","):
        if len(positive_ints("--shapes", shape, "x")) != 2:
            raise ConfigError(f"--shapes={args.shapes!r}: each shape is DxF, e.g. 512x1024")
    if args.repeats < 1:
        raise ConfigError(f"--repeats={args.repeats}: use at least 1")
    if not 0 <= args.max_call_s < math.inf:
        raise ConfigError(
            f"--max-call-s={args.max_call_s}: use a finite number of seconds >= 0 (0: skip every "
            "predicted combination)"
        )


def run_grid(args) -> tuple[list[dict], dict]:
    default = gmm_lib.resolve_backend("auto")
    shapes = [tuple(positive_ints("--shapes", s, "x")) for s in args.shapes.split(",")]
    rows_list = positive_ints("--rows", args.rows)
    experts_list = positive_ints("--experts", args.experts)
    backends = args.backends.split(",")
    bw_gbps, fresh_gbps = copy_bandwidth_gbps()
    dense = {p: _dense_fn(p) for p in PASSES}
    machine = {
        "platform": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "cpu": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "copy_gbps": round(bw_gbps, 2),
        "fresh_copy_gbps": round(fresh_gbps, 2),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    print(jsonio.dumps({"machine": machine}), flush=True)
    results = []
    key = jax.random.key(0)
    groups, passes = args.groups.split(","), args.passes.split(",")
    total = len(experts_list) * len(shapes) * len(rows_list) * len(groups) * len(backends)
    bar = progress.bar(total * len(passes), "bench gmm", unit="case")
    say = progress.say_above(bar, lambda line: print(line, flush=True))
    for experts in experts_list:
        for d, f in shapes:
            w = jax.random.normal(key, (experts, d, f), jnp.float32)
            for n in rows_list:
                x = jax.random.normal(key, (n, d), jnp.float32)
                cot = jax.random.normal(key, (n, f), jnp.float32)
                dense_w = w[0]
                dense_rate = {
                    p: median_seconds(dense[p], _dense_args(p, x, dense_w, cot), args.repeats)
                    for p in PASSES
                }
                for kind in groups:
                    sizes_np = group_sizes(kind, experts, n)
                    sizes = jnp.asarray(sizes_np)
                    for backend in backends:
                        for pass_name in passes:
                            shape = (experts, n, d, f)
                            arrays = (x, w, sizes, sizes_np, cot)
                            reference = (dense, dense_rate, bw_gbps)
                            row = _measure(
                                backend, default, shape, kind, pass_name, arrays, reference, args
                            )
                            bar.update(1)
                            say(jsonio.dumps(row))
                            results.append(row)
            del w
    bar.close()
    return results, machine


def _dense_args(pass_name, x, w_DF, cot):
    return (x, w_DF, None) if pass_name == "fwd" else (x, w_DF, None, cot)


def _measure(backend, default, shape, kind, pass_name, arrays, reference, args) -> dict:
    """One row; the dense reference is re-timed alongside unless the row is skipped.

    shape: (experts, n, d, f); arrays: (x, w, sizes, sizes_np, cot); reference: (dense,
    dense_rate, bw_gbps), the dense matmul of the same FLOPs and its measured rates.
    """
    experts, n, d, f = shape
    x, w, sizes, sizes_np, cot = arrays
    dense, dense_rate, bw_gbps = reference
    mult = 1 if pass_name == "fwd" else 3
    flops = mult * 2.0 * n * d * f
    dense_gflops = flops / dense_rate[pass_name] / 1e9
    used = int(np.count_nonzero(sizes_np))
    weight_bytes = d * f * BYTES_F32 * (used if pass_name == "fwd" else 2 * used + experts)
    roofline_ms = 1e3 * max(flops / (dense_gflops * 1e9), weight_bytes / (bw_gbps * 1e9))
    row = {
        "backend": "auto" if backend == default else backend,
        "impl": backend,
        "experts": experts,
        "rows": n,
        "d": d,
        "f": f,
        "groups": kind,
        "pass": pass_name,
        "gflops": None,
        "dense_gflops": round(dense_gflops, 1),
        "ratio": None,
        "roofline_ms": round(roofline_ms, 2),
        "ms": None,
        "note": "",
    }
    predicted = _predicted_s(backend, experts, flops, dense_gflops)
    if predicted is not None and predicted > args.max_call_s:
        row["note"] = f"skipped: predicted {predicted:.1f} s per call > --max-call-s"
        return row
    matmul = lambda x_, w_, s_: gmm_lib.gmm(x_, w_, s_, backend=backend)
    fn = _pass_fn(matmul, pass_name)
    call_args = (x, w, sizes) if pass_name == "fwd" else (x, w, sizes, cot)
    repeats = args.repeats if (predicted or 0) < 0.5 else max(1, args.repeats // 2)
    seconds, dense_s = _median_pair_s(
        fn, call_args, dense[pass_name], _dense_args(pass_name, x, w[0], cot), repeats
    )
    dense_gflops = flops / dense_s / 1e9
    roofline_ms = 1e3 * max(dense_s, weight_bytes / (bw_gbps * 1e9))
    gflops = flops / seconds / 1e9
    row.update(
        gflops=round(gflops, 1),
        dense_gflops=round(dense_gflops, 1),
        ratio=round(gflops / dense_gflops, 3),
        roofline_ms=round(roofline_ms, 2),
        ms=round(seconds * 1e3, 2),
    )
    if backend == default:
        if n / experts >= 256:
            met = gflops >= 0.8 * dense_gflops
            row["note"] = "target ratio>=0.8: " + ("met" if met else "NOT met")
        else:  # the issue's targets: 1.5x the roofline from 64 rows per expert, 2x below
            limit = 1.5 if n / experts >= 64 else 2.0
            met = seconds * 1e3 <= limit * roofline_ms
            row["note"] = f"target ms<={limit}*roofline: " + ("met" if met else "NOT met")
    return row


def format_table(results: list[dict]) -> str:
    head = (
        f"{'backend':<10} {'impl':<10} {'E':>4} {'N':>6} {'D':>5} {'F':>5} {'groups':<8} "
        f"{'pass':<7} {'ms':>9} {'GFLOP/s':>8} {'dense':>7} {'ratio':>6} {'roof_ms':>8} "
        f"{'ms/roof':>7}  note"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        ms = "-" if r["ms"] is None else f"{r['ms']:.2f}"
        gf = "-" if r["gflops"] is None else f"{r['gflops']:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        per_roof = "-" if r["ms"] is None else f"{r['ms'] / r['roofline_ms']:.2f}"
        lines.append(
            f"{r['backend']:<10} {r['impl']:<10} {r['experts']:>4} {r['rows']:>6} "
            f"{r['d']:>5} {r['f']:>5} {r['groups']:<8} {r['pass']:<7} {ms:>9} "
            f"{gf:>8} {r['dense_gflops']:>7.1f} {ratio:>6} {r['roofline_ms']:>8.2f} "
            f"{per_roof:>7}  {r['note']}"
        )
    return "\n".join(lines)


def format_markdown(results: list[dict], machine: dict) -> str:
    """The table as Markdown (for BENCHMARKS.md), with the machine line above it."""
    lines = [
        f"{machine['date']}, {machine['device']} ({machine['cpu']}), jax {machine['jax']}; "
        f"copy {machine['copy_gbps']} GB/s in place, {machine['fresh_copy_gbps']} GB/s "
        "into a fresh buffer.",
        "",
        "| backend | impl | E | N | D | F | groups | pass | ms | GFLOP/s | dense GFLOP/s "
        "| ratio | roofline ms | ms/roofline | note |",
        "|" + "---|" * 15,
    ]
    for r in results:
        cells = [
            r["backend"],
            r["impl"],
            r["experts"],
            r["rows"],
            r["d"],
            r["f"],
            r["groups"],
            r["pass"],
            r["ms"],
            r["gflops"],
            r["dense_gflops"],
            r["ratio"],
            r["roofline_ms"],
            None if r["ms"] is None else round(r["ms"] / r["roofline_ms"], 2),
            r["note"],
        ]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expertax bench gmm", description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write {'machine': ..., 'rows': [...]} here")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown here")
    p.add_argument(
        "--from-json",
        metavar="PATH",
        help="do not measure: print (and --markdown) a table from an earlier --json",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small subset: E in {8, 64}, N=4096, (512, 1024), balanced and zipf",
    )
    p.add_argument(
        "--backends",
        default="tiled,ragged_dot",
        help=f"comma list of {', '.join(gmm_lib.BACKENDS[1:])}",
    )
    p.add_argument("--experts", default="8,64,256")
    p.add_argument("--rows", default="4096,16384")
    p.add_argument("--shapes", default="512x1024,1024x512", help="comma list of DxF")
    p.add_argument("--groups", default=",".join(GROUPINGS))
    p.add_argument("--passes", default=",".join(PASSES))
    p.add_argument("--repeats", type=int, default=5, help="timed calls per row (median)")
    p.add_argument(
        "--max-call-s",
        type=float,
        default=2.0,
        help="skip ragged_dot combinations predicted to take longer per call (E x a dense matmul)",
    )
    add_overwrite_flag(p)
    return p


def main(argv: list[str]) -> int:
    if any(a == "--target" or a.startswith("--target=") for a in argv):
        from expertax.tools import bench_gmm_target

        return bench_gmm_target.main(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    outputs = {"--json": args.json, "--markdown": args.markdown}
    check_apart(outputs, {"--from-json": args.from_json})
    for flag, path in outputs.items():
        check_file(flag, path, args.overwrite)
    if args.from_json is not None:
        unread_with("--from-json", parser, args, MEASURING)
    if args.quick:
        args.experts, args.rows, args.shapes = "8,64", "4096", "512x1024"
        args.groups, args.repeats = "balanced,zipf", 3
    check_args(args)
    started = time.perf_counter()
    if args.from_json is not None:  # an empty one is refused, not "measure"
        results, machine = read_saved(args.from_json)
    else:
        results, machine = run_grid(args)
    print(format_table(results))
    skipped = sum(r["ms"] is None for r in results)
    print(
        f"{len(results)} rows ({skipped} skipped) in {time.perf_counter() - started:.0f} s; "
        f"copy bandwidth {machine['copy_gbps']} GB/s in place, {machine['fresh_copy_gbps']} GB/s "
        "into a fresh buffer"
        + ("" if args.from_json is not None else f"; median of {args.repeats} calls")
    )
    if args.json:
        with open(args.json, "w") as fh:
            jsonio.dump({"machine": machine, "rows": results}, fh, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(format_markdown(results, machine))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:
        print(f"expertax bench gmm: error: {e}", file=sys.stderr)
        sys.exit(2)
