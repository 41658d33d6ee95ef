"""Grouped-matmul benchmark; same as `expertax bench gmm` (see expertax.tools.bench_gmm)."""

import sys

from expertax.tools.bench_gmm import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
