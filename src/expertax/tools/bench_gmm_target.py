"""`expertax bench gmm --target T`: the grouped-matmul backends compiled for a TPU or GPU target.

Nothing runs: each (backend, experts E, rows per expert, pass) is one single-operation program
(`[M, D] x [E, D, F]`, M = E x rows per expert, operands in `--dtype`) compiled for one device
of the target from this machine, and read back:
- `compiled_flops`: the matmul FLOPs in the optimized program (planner/flops.py: dots and
  convolutions, cuBLAS calls, XLA's own ragged-dot kernel; loops at their trip counts, the tiled
  backend's data-dependent loops at the balanced count they name); grouped kernels (tokamax,
  megablox) from their tiling at the balanced group sizes of the row: each group of
  `rows per expert` rows in row blocks of the kernel (planner/kernels.py);
- `worst_flops`: the same with every grouped kernel at the most its grid can compute for any
  group sizes that fill the buffer's M rows (one extra partial block per group boundary): the
  cost that follows the buffer, not the routed rows (EP's worst-case receive buffers);
- `routed_flops`: 2 M D F forward, 3x that forward + backward;
- `temp_bytes`: the compiled program's temporaries; `out_bytes`: its outputs (the result, and
  for fwd_bwd the input and weight gradients);
- `kernel`: what does the matmuls in the program.
GPU compiles without a GPU cannot autotune and `cost_analysis()` returns nothing there; these
counts are read from the program text instead. No time comes out of a compile.

Run in pieces (`--backends`, `--experts`, `--rows-per-expert`, `--passes`), each with its own
`--json`; `--from-json a.json,b.json --markdown t.md` merges pieces into one table (and
`--json` into one file).
"""

from __future__ import annotations

import argparse
import logging
import platform as host
import time

from expertax import jsonio
from expertax.config import ConfigError
from expertax.outputs import add_overwrite_flag, check_apart, check_file
from expertax.tools.flags import gmm_backends, positive_ints, saved_json, unread_with

PASSES = ("fwd", "fwd_bwd")
# The text and path flags' kinds (cli/flags.py TEXT_KINDS: what each takes and must refuse).
KINDS = {
    "--target": "target",
    "--backends": "gmm backends",
    "--experts": "positive ints",
    "--rows-per-expert": "positive ints",
    "--shape": "shape",
    "--passes": "choice list",
    "--json": "output file",
    "--markdown": "output file",
    "--from-json": "input json list",
}
# The flags that say what to compile: read only when compiling (refused with --from-json).
COMPILING = ("--backends", "--experts", "--rows-per-expert", "--shape", "--passes", "--dtype")
# What `--from-json` needs of a file a `--json` run wrote (format_table, format_markdown).
ROW_KEYS: tuple[str, ...] = ("target", "backend", "impl", "pass", "experts", "rows_per_expert")
ROW_KEYS += ("rows", "flops_ratio", "worst_ratio", "temp_bytes", "out_bytes", "temp_ratio")
ROW_KEYS += ("kernel",)
MACHINE_KEYS = ("date", "host", "jax", "loadavg")
DEFAULT_BACKENDS = {
    "gpu": "tiled,ragged_dot,tokamax_triton,tokamax_mosaic_gpu",
    "tpu": "tiled,ragged_dot,megablox",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="expertax bench gmm --target", description=__doc__.splitlines()[0]
    )
    p.add_argument("--target", required=True, help="tpu:<slice> or gpu:<chip>x<n> (compiled for)")
    p.add_argument("--backends", help="comma list (default: the platform's kernel backends)")
    p.add_argument("--experts", default="8,64,256")
    p.add_argument("--rows-per-expert", default="16,64,256,512")
    p.add_argument("--shape", default="2048x1024", help="DxF")
    p.add_argument("--passes", default=",".join(PASSES))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--json", metavar="PATH", help="write {'machine': ..., 'rows': [...]} here")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown here")
    p.add_argument(
        "--from-json",
        metavar="PATHS",
        help="compile nothing: a table from earlier --json files (comma list, merged)",
    )
    add_overwrite_flag(p)
    return p


def _grid(args, on: str):
    from expertax.nn.moe import gmm as gmm_lib

    given = args.backends is not None  # an empty --backends is refused, not the default
    text = args.backends if given else DEFAULT_BACKENDS.get(on, "tiled")
    backends = gmm_backends("--backends", text, gmm_lib.BACKENDS, on)
    passes = args.passes.split(",")
    if any(p not in PASSES for p in passes):
        raise ConfigError(f"--passes={args.passes!r}: use {', '.join(PASSES)}")
    shape = positive_ints("--shape", args.shape, "x")
    if len(shape) != 2:
        raise ConfigError(f"--shape={args.shape!r}: one DxF, e.g. 2048x1024")
    d, f = shape
    experts = positive_ints("--experts", args.experts)
    per = positive_ints("--rows-per-expert", args.rows_per_expert)
    return [(b, e, r, p) for b in backends for e in experts for r in per for p in passes], (d, f)


def compile_row(target, backend: str, experts: int, per: int, pass_name: str, d: int, f: int, dt):
    """One compiled program's figures (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from expertax import platform
    from expertax.nn.moe import gmm as gmm_lib
    from expertax.nn.moe import tiles
    from expertax.planner import flops as flops_lib

    device = target.devices()[0]
    one = NamedSharding(Mesh([device], ("one",)), PartitionSpec())
    m = experts * per
    spec = lambda shape, dtype=dt: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
    args = [spec((m, d)), spec((experts, d, f)), spec((experts,), jnp.int32)]

    def fwd(x, w, sizes):
        return gmm_lib.gmm(x, w, sizes, backend=backend)

    def fwd_bwd(x, w, sizes, dy):
        out, vjp = jax.vjp(lambda a, b: fwd(a, b, sizes), x, w)
        return out, *vjp(dy)

    fn = fwd if pass_name == "fwd" else fwd_bwd
    if pass_name == "fwd_bwd":
        args.append(spec((m, f)))
    started = time.perf_counter()
    with platform.use(target.platform, device), tiles.expected_group_rows(per):
        compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - started
    text = compiled.as_text() or ""
    count = flops_lib.count_flops(text)
    mem = compiled.memory_analysis()
    assert mem is not None, "the TPU and GPU compilers report their buffers"
    routed = (1 if pass_name == "fwd" else 3) * 2 * m * d * f
    impl = gmm_lib.resolve_backend(backend, target.platform)
    return {
        "target": target.spec,
        "backend": "auto" if impl == gmm_lib.resolve_backend("auto", target.platform) else impl,
        "impl": impl,
        "pass": pass_name,
        "experts": experts,
        "rows_per_expert": per,
        "rows": m,
        "d": d,
        "f": f,
        "dtype": jnp.dtype(dt).name,
        "routed_flops": routed,
        "compiled_flops": count.flops,
        "worst_flops": count.worst_flops,
        "flops_ratio": round(count.flops / routed, 3),
        "worst_ratio": round(count.worst_flops / routed, 3),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "out_bytes": int(mem.output_size_in_bytes),
        "temp_ratio": round(mem.temp_size_in_bytes / mem.output_size_in_bytes, 3),
        "kernel": describe_kernels(text, count),
        "opaque": len(count.opaque),
        "compile_s": round(seconds, 1),
    }


def describe_kernels(text: str, count) -> str:
    """What does the matmuls: the grouped kernels, else the program's dot-carrying ops."""
    from collections import Counter

    from expertax.planner.hlo import parse_hlo

    if count.kernels:
        seen = Counter(k.describe() for k in count.kernels)
        return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in seen.items())
    module = parse_hlo(text)
    found: Counter[str] = Counter()
    for ins in module.instructions.values():
        if ins.opcode == "custom-call":
            target = ins.attrs.split('custom_call_target="', 1)[-1].split('"', 1)[0]
            if any(t in target for t in ("cublas", "cudnn", "tpu_custom_call", "triton")):
                found[target] += 1
        elif ins.opcode in ("dot", "convolution") and ins.computation in module.callers:
            found[f"{ins.opcode} in a while loop"] += 1
        elif ins.opcode in ("dot", "convolution", "ragged-dot"):
            found[ins.opcode] += 1
    loops = sum(1 for i in module.instructions.values() if i.opcode == "while")
    parts = [f"{k} x{v}" for k, v in sorted(found.items())]
    return ", ".join(parts + ([f"{loops} while loops"] if loops else [])) or "-"


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'target':<11} {'backend':<19} {'pass':<7} {'E':>4} {'rows/E':>6} {'M':>7} "
        f"{'flops/routed':>12} {'worst/routed':>12} {'temp MiB':>9} {'out MiB':>8} "
        f"{'temp/out':>8}  kernel"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        name = r["backend"] if r["backend"] != "auto" else f"auto={r['impl']}"
        lines.append(
            f"{r['target']:<11} {name:<19} {r['pass']:<7} {r['experts']:>4} "
            f"{r['rows_per_expert']:>6} {r['rows']:>7} {r['flops_ratio']:>12.3f} "
            f"{r['worst_ratio']:>12.3f} {r['temp_bytes'] / 2**20:>9.2f} "
            f"{r['out_bytes'] / 2**20:>8.1f} {r['temp_ratio']:>8.3f}  {r['kernel']}"
        )
    return "\n".join(lines)


def format_markdown(rows: list[dict], machine: dict) -> str:
    lines = [
        f"{machine['date']}, compiled (not run) on {machine['host']} with jax {machine['jax']}"
        + (f", tokamax {machine['tokamax']}" if machine.get("tokamax") else "")
        + f"; load average {machine['loadavg']}.",
        "",
        "| target | backend | pass | E | rows/E | M | compiled / routed flops | worst / routed "
        "| temp MiB | out MiB | temp / out | kernel |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        name = r["backend"] if r["backend"] != "auto" else f"auto ({r['impl']})"
        cells = [
            r["target"],
            name,
            r["pass"],
            r["experts"],
            r["rows_per_expert"],
            r["rows"],
            f"{r['flops_ratio']:.3f}",
            f"{r['worst_ratio']:.3f}",
            f"{r['temp_bytes'] / 2**20:.2f}",
            f"{r['out_bytes'] / 2**20:.1f}",
            f"{r['temp_ratio']:.3f}",
            r["kernel"],
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _machine() -> dict:
    import importlib.metadata

    import jax

    try:
        tokamax = importlib.metadata.version("tokamax")
    except importlib.metadata.PackageNotFoundError:
        tokamax = None
    with open("/proc/loadavg") as fh:
        load = " ".join(fh.read().split()[:3])
    return {
        "host": f"{host.node()} ({host.processor() or host.machine()})",
        "jax": jax.__version__,
        "tokamax": tokamax,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "loadavg": load,
    }


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    outputs = {"--json": args.json, "--markdown": args.markdown}
    inputs = (args.from_json or "").split(",")
    check_apart(outputs, [("--from-json", path) for path in inputs])
    for flag, path in outputs.items():
        check_file(flag, path, args.overwrite)
    if args.from_json is not None:  # an empty one is refused, not "compile"
        unread_with("--from-json", parser, args, COMPILING)
        rows: list[dict] = []
        keys = {"rows": ROW_KEYS, "machine": MACHINE_KEYS}
        pieces: list[dict] = []
        for path in args.from_json.split(","):
            fix = "give a comma list of files --json runs wrote"
            saved = saved_json("--from-json", path, keys, fix)
            rows += saved["rows"]
            pieces.append(saved["machine"])
        loads = dict.fromkeys(m["loadavg"] for m in pieces)  # one per piece, in order
        machine = {**pieces[0], "loadavg": " / ".join(loads)}
    else:
        rows, machine = _run(args)
    print(format_table(rows))
    if args.json:  # with --from-json, the pieces merged
        with open(args.json, "w") as fh:
            jsonio.dump({"machine": machine, "rows": rows}, fh, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(format_markdown(rows, machine))
    return 0


def _run(args) -> tuple[list[dict], dict]:
    from expertax import progress
    from expertax.targets import parse_target, prepare_process

    target = parse_target(args.target)
    if target.is_cpu:
        raise ConfigError(
            "--target=cpu: the CPU grid is timed, run `expertax bench gmm` without it"
        )
    grid, (d, f) = _grid(args, target.platform)  # every flag checked before the compiler loads
    prepare_process(target)
    # tokamax warns once per kernel that its autotuning cache has no entry for these shapes
    # (then uses its heuristics, which the rows report); a compile-only run cannot autotune.
    logging.getLogger("absl").setLevel(logging.ERROR)
    import jax.numpy as jnp

    machine = {**_machine(), "target": target.describe()}
    print(jsonio.dumps({"machine": machine}), flush=True)
    bar = progress.bar(len(grid), "bench gmm --target", unit="compile")
    say = progress.say_above(bar, lambda line: print(line, flush=True))
    rows = []
    for backend, experts, per, pass_name in grid:
        row = compile_row(target, backend, experts, per, pass_name, d, f, jnp.dtype(args.dtype))
        rows.append(row)
        bar.update(1)
        say(jsonio.dumps(row))
    bar.close()
    return rows, machine
