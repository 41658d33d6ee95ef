"""Progress bars: shown on a terminal only; lines pass through unchanged otherwise."""

from __future__ import annotations

import io
import sys

from expertax import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_enabled_only_on_a_terminal():
    assert progress.enabled(Terminal())
    assert not progress.enabled(io.StringIO())  # a file or pipe: logs stay clean


def test_off_a_terminal_the_bar_is_silent_and_lines_pass_through(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    lines: list[str] = []
    echo = lines.append
    b = progress.bar(3, "work")
    assert b.disable
    assert progress.say_above(b, echo) is echo
    assert list(progress.each([1, 2, 3], "items")) == [1, 2, 3]
    b.update(3)
    b.close()
    assert sys.stderr.getvalue() == ""


def test_on_a_terminal_the_bar_draws_and_lines_go_above_it(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    lines: list[str] = []
    b = progress.bar(4, "parity", unit="layout")
    assert not b.disable
    say = progress.say_above(b, lines.append, file=terminal)
    b.update(2)
    say("row 1")
    b.close()
    out = terminal.getvalue()
    assert "parity" in out and "2/4" in out and "row 1" in out
    assert lines == []  # printed through the bar, not the plain echo
    assert progress.bar(4, "other", off=True).disable
