"""Progress bars for the long commands (train, parity, memory --fit, bench), with tqdm.

A bar is shown only when its stream (stderr) is a terminal, so logs and CI output stay clean:
off a terminal `bar(...)` returns a disabled tqdm, whose `update` and `write` cost nothing extra.
`Bar.say` prints a line above a live bar (or plainly, when the bar is off) so the console lines
of a command and its bar do not tear each other.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def enabled(stream: Any = None) -> bool:
    """Whether progress is shown on `stream` (default stderr): only on a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def bar(
    total: int | None, desc: str, *, initial: int = 0, unit: str = "it", off: bool = False
) -> tqdm:
    """A tqdm bar on stderr, disabled unless stderr is a terminal (or when `off`); `leave=False`
    so the finished bar is erased and the command's own lines remain."""
    return tqdm(
        total=total,
        desc=desc,
        initial=initial,
        unit=unit,
        disable=off or not enabled(),
        leave=False,
        dynamic_ncols=True,
        file=sys.stderr,
    )


def each(items: Iterable[T], desc: str, *, total: int | None = None) -> Iterator[T]:
    """`items` one by one with a bar 'desc i/n' (n from len(items) when not given)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with bar(total, desc) as b:
        for item in items:
            yield item
            b.update(1)


def say_above(b: tqdm, echo: Callable[[str], None], file: Any = None) -> Callable[[str], None]:
    """A `say` that prints to `file` (default stdout) through tqdm when the bar is live (so the
    bar is redrawn below the line), else through `echo` unchanged (tests capture `echo`)."""
    if b.disable:
        return echo
    return lambda line: b.write(line, file=sys.stdout if file is None else file)
