"""`python -m expertax.cli`: the `expertax` command without its re-execution (`main` alone)."""

import sys

from expertax.cli import main

if __name__ == "__main__":
    sys.exit(main())
