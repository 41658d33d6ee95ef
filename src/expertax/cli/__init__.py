"""`expertax train | memory | parity | bench | convert | report | generate` — the command line.

Positional arguments ending in .yml/.yaml are preset files; `key=value` arguments override keys.
User errors print one line naming the key and value, and exit with status 2.

The `expertax` console command is `command` (pyproject's `[project.scripts]`), in two steps:
1. host memory: the process re-executes itself once with glibc's huge-page tunable set
   (`hostmem.reexec_with_hugepages`; a tunable is read only when a process starts, so this comes
   before anything else is imported: this package's imports are the standard library's, the
   rest load inside the commands); `EXPERTAX_HUGEPAGES=0` skips it;
2. `main`: parse the arguments and run the subcommand.
`python -m expertax.cli` (`__main__.py`) runs step 2 alone.

One module per command (`train`, `parity`, `memory`, `convert`, `bench`, `report`, `generate`),
each with its help line (`HELP`), its subparser (`add_parser`) and what it does (`run`);
`parser.py` puts them together, `args.py` turns the config arguments into a config, and
`devices.py` holds `--target` and the simulated CPU devices of memory and parity.
"""

from __future__ import annotations

import sys

from expertax import startup  # the standard library only, like this package's modules

# Only the standard library at import time (see `command`); expertax's modules load in the commands.


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: this process's arguments) and run the subcommand; a user error
    prints one line and returns 2."""
    startup.prepare()  # before anything imports JAX
    from expertax.cli import flags
    from expertax.cli.parser import COMMANDS, parse_args
    from expertax.config import ConfigError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    args.argv = argv
    try:
        flags.check(args, COMMANDS[args.command].LIMITS)  # before the command does any work
        return COMMANDS[args.command].run(args)
    except ConfigError as e:
        print(f"expertax: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`expertax train --help-keys | head`)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 1


def command() -> int:
    """The `expertax` console command: step 1, re-execute once with huge pages on (nothing of
    JAX is loaded yet; `EXPERTAX_HUGEPAGES=0`: as it is); step 2, `main`."""
    from expertax import hostmem

    hostmem.reexec_with_hugepages([sys.executable, "-m", "expertax.cli", *sys.argv[1:]])
    return main()
