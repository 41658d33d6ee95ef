"""What a long conversion shows and remembers: a progress line, and the journal that resumes it.

The journal lives in `OUT_DIR/.convert/` while a conversion runs: `state.json` (what is being
converted, so that a rerun with another source is refused rather than mixed in) and `done.txt`
(one finished unit per line, appended only after the unit's bytes are written). A rerun with the
same command skips the units listed; the directory is removed once the output is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from expertax import jsonio

STATE_DIR = ".convert"
# Test hook: exit (status 75) right after this many units were journaled in this process.
EXIT_AFTER_ENV = "EXPERTAX_CONVERT_EXIT_AFTER"
# "1": draw the progress line even when stderr is not a terminal (logs, tests)
PROGRESS_ENV = "EXPERTAX_CONVERT_PROGRESS"


class Journal:
    """Finished units of an interrupted conversion of `state` into `out_dir`."""

    def __init__(self, out_dir: Path, state: dict):
        self.dir = Path(out_dir) / STATE_DIR
        self.state = state
        self.done: set[str] = set()
        self._file: Any = None
        self._added = 0
        self._exit_after = int(os.environ.get(EXIT_AFTER_ENV, "0") or 0)

    @staticmethod
    def resumable(out_dir: Path) -> bool:
        return (Path(out_dir) / STATE_DIR / "state.json").is_file()

    def open(self) -> Journal:
        """Start, or resume when `out_dir` holds a journal of the same conversion."""
        state_file = self.dir / "state.json"
        if state_file.is_file():
            old = json.loads(state_file.read_text())
            if old != self.state:
                diff = {k: (old.get(k), v) for k, v in self.state.items() if old.get(k) != v}
                raise ValueError(
                    f"{self.dir.parent} holds an unfinished conversion of something else "
                    f"({diff}); rerun that command, or choose a new directory"
                )
            done = self.dir / "done.txt"
            if done.is_file():  # a line cut by a kill has no newline: not done
                text = done.read_text()
                self.done = {line for line in text.split("\n")[:-1] if line}
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = self.dir / "state.json.tmp"
            tmp.write_text(jsonio.dumps(self.state, sort_keys=True))
            tmp.replace(state_file)
        self._file = open(self.dir / "done.txt", "a")  # noqa: SIM115 (closed in close/finish)
        return self

    def add(self, key: str) -> None:
        self._file.write(key + "\n")
        self._file.flush()
        self.done.add(key)
        self._added += 1
        if self._exit_after and self._added >= self._exit_after:
            os._exit(75)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self) -> None:
        """The output is complete: forget the journal."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Progress:
    """`label: 1234/5678 tensors  12.3/45.6 GiB  0.81 GiB/s  ETA 41 s` on stderr, redrawn at
    most twice a second, when stderr is a terminal, or `force` (default: PROGRESS_ENV is "1")."""

    def __init__(self, label: str, units: int, nbytes: int, *, stream=None, force=None):
        self.label, self.units, self.nbytes = label, units, nbytes
        self.stream = stream or sys.stderr
        if force is None:
            force = os.environ.get(PROGRESS_ENV) == "1"
        self.enabled = force or (hasattr(self.stream, "isatty") and self.stream.isatty())
        self.done_units = 0
        self.done_bytes = 0
        self.start = time.perf_counter()
        self._drawn = 0.0

    def advance(self, nbytes: int) -> None:
        self.done_units += 1
        self.done_bytes += nbytes
        now = time.perf_counter()
        if self.enabled and (now - self._drawn > 0.5 or self.done_units == self.units):
            self._drawn = now
            self.stream.write("\r" + self.line(now) + "\033[K")
            self.stream.flush()

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done_bytes / elapsed
        left = (self.nbytes - self.done_bytes) / rate if rate > 0 else float("inf")
        eta = f"{left:.0f} s" if left != float("inf") else "?"
        return (
            f"{self.label}: {self.done_units}/{self.units} tensors  "
            f"{self.done_bytes / 2**30:.2f}/{self.nbytes / 2**30:.2f} GiB  "
            f"{rate / 2**30:.2f} GiB/s  ETA {eta}"
        )

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
