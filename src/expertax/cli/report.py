"""`expertax report RUN_DIR`: plots and an index.html of a run folder (tools/report.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from expertax.cli import flags
from expertax.outputs import add_overwrite_flag, check_apart, check_folder

HELP = "plots and an index.html of a run folder: expertax report RUN_DIR [--layer I] [--out DIR]"
# The numeric flags' valid values (checked before any work: cli/flags.py).
LIMITS = {"--layer": flags.count(0, "an MoE layer's index")}
# The text and path flags' kinds (cli/flags.py TEXT_KINDS: what each takes and must refuse).
KINDS = {"--out": "output folder"}


def add_parser(sub) -> argparse.ArgumentParser:
    report = sub.add_parser("report", help=HELP)
    report.add_argument(
        "run_dir", help="a training run folder (<base_output_directory>/<run_name>)"
    )
    report.add_argument(
        "--layer", type=int, default=0, help="MoE layer whose expert loads are drawn over steps"
    )
    report.add_argument(
        "--out",
        default=None,
        help="output folder (default: RUN_DIR/report, rewritten each time), outside RUN_DIR "
        "otherwise; one holding the report's files already is refused without --overwrite",
    )
    add_overwrite_flag(report)
    return report


def run(args) -> int:
    from expertax.tools.report import REPORT_SUBDIR, make_report, report_files

    own = Path(args.run_dir, REPORT_SUBDIR).resolve()  # the default: the report's own folder
    if args.out is not None and Path(args.out).resolve() != own:
        hint = f" (or leave --out out: RUN_DIR/{REPORT_SUBDIR} is the report's own)"
        check_apart({"--out": args.out}, {"RUN_DIR": args.run_dir}, hint=hint)
        check_folder("--out", args.out, report_files(args.layer), args.overwrite)
    else:  # rewritten each time; still a folder that can be written in
        check_folder("the report folder", str(own), (), overwrite=True)
    result = make_report(args.run_dir, out_dir=args.out, layer=args.layer)
    print(f"expertax: wrote {len(result['plots'])} plots and index.html to {result['out_dir']}")
    return 0
