"""`expertax bench gmm ...`: benchmarks, each parsing its own flags (tools/bench_gmm.py)."""

from __future__ import annotations

import argparse

from expertax.cli import flags

HELP = "benchmarks: expertax bench gmm [--json PATH] [--quick] [--target T] ..."
LIMITS: dict[str, flags.Limit] = {}  # the benchmarks check their own flags (tools/bench_gmm.py)
KINDS: dict[str, str] = {}  # and declare their own KINDS there


def add_parser(sub) -> argparse.ArgumentParser:
    bench = sub.add_parser("bench", help=HELP)
    bench.add_argument("what", choices=("gmm",), help="which benchmark")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    return bench


def run(args) -> int:
    from expertax.tools import bench_gmm

    benches = {"gmm": bench_gmm.main}
    return benches[args.what](args.rest)
