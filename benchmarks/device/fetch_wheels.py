"""Download the wheels the device check carries to the GPU machine (wheels.txt: Python 3.12,
x86-64 Linux, no dependencies resolved: the list is the closure) into benchmarks/device/wheels/
(ignored by git), and print their count and bytes. Run on a machine with PyPI:

    python benchmarks/device/fetch_wheels.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WHEELS = HERE / "wheels"
LIMIT = 60 * 2**20  # what the check may carry (the device machine's copy takes 64 MiB in all)


def requirements() -> list[str]:
    lines = (HERE / "wheels.txt").read_text().splitlines()
    return [x.strip() for x in lines if x.strip() and not x.startswith("#")]


def main() -> int:
    WHEELS.mkdir(exist_ok=True)
    for old in WHEELS.glob("*.whl"):
        old.unlink()
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--abi",
        "cp312",
        "--platform",
        "manylinux2014_x86_64",
        "--platform",
        "manylinux_2_17_x86_64",
        "--platform",
        "manylinux_2_28_x86_64",
        "-d",
        str(WHEELS),
        *requirements(),
    ]
    subprocess.run(cmd, check=True)
    files = sorted(WHEELS.glob("*.whl"))
    size = sum(f.stat().st_size for f in files)
    print(f"{len(files)} wheels, {size / 2**20:.1f} MiB in {WHEELS}")
    if size > LIMIT:
        print(f"over the {LIMIT / 2**20:.0f} MiB the device machine takes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
