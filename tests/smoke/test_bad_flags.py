"""Every flag of every command, walked from the argument parsers (the benchmarks' own parsers
too): a bad value ends the command with a non-zero status and one message naming the flag, before
any work, without a traceback and without writing or changing a file. What is bad comes by rule:
a numeric flag's from its limit (cli/flags.py `LIMITS`: not a number, inf, nan, past either end),
a choice flag's from its choices, a text or path flag's from its kind (each command's `KINDS`,
cli/flags.py `TEXT_KINDS`: a missing file, a folder where a file goes, an existing output without
--overwrite, a malformed list, an empty value); a flag that takes no value (`store_true`) has none
to be bad. A flag with none of these fails `test_every_flag_of_every_command_is_covered`, so a new
flag cannot slip by. In-process through `expertax.cli.main` (a process per case would take
minutes); a few cases run as a user runs them. `SUMMARY` says how many flags and cases."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from expertax import cli
from expertax.cli import flags as cli_flags
from expertax.cli import parser as cli_parser
from expertax.tools import bench_gmm, bench_gmm_target

# What each command needs besides the flag to reach its flags' checks.
POSITIONALS = {
    "generate": ["SOURCE"],
    "convert": ["from-hf", "HF_DIR", "OUT_DIR"],
    "report": ["RUN"],
    "steptime": ["PROGRAM"],
}
NUMERIC = (int, float)
BENCH_NUMERIC_BAD = ("many", "-1", "nan", "inf")  # the benchmarks check their numbers themselves


@dataclasses.dataclass(frozen=True)
class Command:
    """A parser, the tables that say what its flags take, and the arguments before a flag."""

    parser: argparse.ArgumentParser
    limits: dict[str, cli_flags.Limit]
    kinds: dict[str, str]
    head: tuple[str, ...]

    def argv(self, flag: str, value: str) -> list[str]:
        head = list(self.head)
        if flag in head:  # the flag the head gives (bench's --target): given alone
            i = head.index(flag)
            del head[i : i + 2]
        return [*head, f"{flag}={value}"]


def commands() -> dict[str, Command]:
    """Every parser a user reaches: each command's, and `bench gmm`'s two of its own."""
    _, subs = cli_parser.build_parser()
    out = {}
    for name, sub in subs.items():
        module = cli_parser.COMMANDS[name]
        head = (name, *POSITIONALS.get(name, []))
        out[name] = Command(sub, module.LIMITS, module.KINDS, head)
    out["bench gmm"] = Command(bench_gmm._parser(), {}, bench_gmm.KINDS, ("bench", "gmm"))
    target_head = ("bench", "gmm", "--target", "gpu:h100x8")
    out["bench gmm --target"] = Command(
        bench_gmm_target._parser(), {}, bench_gmm_target.KINDS, target_head
    )
    return out


def _flag_actions(parser):
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def _flag(action) -> str:
    return max(action.option_strings, key=len)


def rule(name: str, command: Command, action) -> str:
    """How the flag's bad values are found: "no value", "choices", "limit", "numeric" (a
    benchmark's own), "kind", or "none" (a flag nothing covers)."""
    if action.nargs == 0:
        return "no value"
    if action.choices is not None:
        return "choices"
    if action.type in NUMERIC:
        return "numeric" if name.startswith("bench gmm") else "limit"
    return "kind" if _flag(action) in command.kinds else "none"


def bad_values(name: str, command: Command, action) -> list[str]:
    """The values of a flag that must be refused."""
    how, flag = rule(name, command, action), _flag(action)
    if how == "choices":
        return ["no-such-choice", ""]
    if how == "numeric":
        return list(BENCH_NUMERIC_BAD)
    if how == "kind":
        return list(cli_flags.TEXT_KINDS[command.kinds[flag]].bad)
    if how != "limit" or flag not in command.limits:
        return []
    limit = command.limits[flag]
    values = ["many", "inf", "nan", "-inf"]
    values.append(str(limit.low if limit.low_open else limit.low - 1))
    if not math.isinf(limit.high):
        values.append(str(limit.high if limit.high_open else limit.high + 1))
    if action.type is int:
        values.append("1.5")
    return values


COMMANDS = commands()
FLAGS = [(name, c, a) for name, c in COMMANDS.items() for a in _flag_actions(c.parser)]
CASES = [
    (name, _flag(a), v) for name, c, a in FLAGS for v in bad_values(name, c, a)
]  # (command, flag, bad value)
RULES = [rule(name, c, a) for name, c, a in FLAGS]
COVERED = sum(how != "none" for how in RULES)
SUMMARY = (
    f"{len(FLAGS)} flags in {len(COMMANDS)} parsers, {COVERED} covered "
    f"({', '.join(f'{RULES.count(h)} by {h}' for h in sorted(set(RULES)))}), "
    f"{len(CASES)} bad values run"
)


def test_every_flag_of_every_command_is_covered():
    """Each flag has a rule that gives it bad values (or none to give: no value, free text);
    every table names existing flags only, and kinds that exist."""
    print(SUMMARY)
    uncovered = [(name, _flag(a)) for (name, _, a), how in zip(FLAGS, RULES) if how == "none"]
    assert uncovered == [], "give each a kind in its command's KINDS (cli/flags.py TEXT_KINDS)"
    assert COVERED == len(FLAGS)
    for name, command in COMMANDS.items():
        flags = {_flag(a) for a in _flag_actions(command.parser)}
        assert set(command.kinds) <= flags, (name, set(command.kinds) - flags)
        assert set(command.kinds.values()) <= set(cli_flags.TEXT_KINDS), name
    free = [k for k, kind in cli_flags.TEXT_KINDS.items() if not kind.bad]
    assert free == ["free text"]  # the one kind without a malformed value
    valued = {(name, flag) for name, flag, _ in CASES}
    for (name, _, action), how in zip(FLAGS, RULES):
        kind = COMMANDS[name].kinds.get(_flag(action))
        if how != "no value" and kind not in free:
            assert (name, _flag(action)) in valued, (name, _flag(action))


def test_every_numeric_flag_has_a_limit_of_its_type():
    for name, command in COMMANDS.items():
        if name.startswith("bench gmm"):
            continue  # the benchmark checks its own numbers (tools/bench_gmm.py check_args)
        numeric = {_flag(a): a.type for a in _flag_actions(command.parser) if a.type in NUMERIC}
        assert set(numeric) == set(command.limits), name
        for flag, kind in numeric.items():
            assert command.limits[flag].integer == (kind is int), flag


def _fill(value: str, root: Path) -> str:
    return value.format(
        missing=root / "no-such-path",
        folder=root / "folder",
        file=root / "exists.json",
        not_json=root / "not.json",
        not_utf8=root / "latin1.json",
        device=os.devnull,
        locked="/proc",  # nothing can be made there, root or not (Linux)
    )


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code if isinstance(e.code, int) else 1
    return rc, capsys.readouterr().err


def test_every_bad_flag_value_is_refused_naming_the_flag(capsys, tmp_path, monkeypatch):
    root = tmp_path.resolve()
    (root / "folder").mkdir()
    (root / "exists.json").write_text("{}\n")
    (root / "not.json").write_text("not json\n")
    (root / "latin1.json").write_bytes('{"prompt": "café"}\n'.encode("latin-1"))
    monkeypatch.chdir(root)
    before = _snapshot(root)
    assert len(CASES) > 200
    for name, flag, value in CASES:
        filled = _fill(value, root)
        rc, err = _run(COMMANDS[name].argv(flag, filled), capsys)
        assert rc != 0, (name, flag, filled)
        last = err.strip().splitlines()[-1] if err.strip() else ""  # argparse's usage lists all
        assert "error:" in last and flag in last, (name, flag, filled, err)
        assert "Traceback" not in err, (name, flag, filled, err)
        assert _snapshot(root) == before, (name, flag, filled)  # nothing written or changed


def test_good_flag_values_pass_the_limits():
    """Negative control: each limit takes its own low end (or just above it) and a middle value."""
    for command in COMMANDS.values():
        for flag, limit in command.limits.items():
            low = limit.low + (0.5 if limit.low_open else 0)
            assert limit.holds(low), flag
            assert not limit.holds(math.nan) and not limit.holds(math.inf), flag


def run_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "expertax.cli", *args],
        cwd=cwd,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "args, words",
    [
        (["memory", "--hbm=-4"], ["--hbm=-4.0", "> 0"]),
        (["train", "dataset_type=files", "dataset_path=nope.jsonl", "tokenizer_path=t.json"],
         ["dataset_path='nope.jsonl'", "no such file"]),
    ],
)  # fmt: skip
def test_a_user_sees_one_line_and_status_2(args, words, tmp_path):
    """As a user runs it: a refusal in seconds, one line, exit status 2, nothing written."""
    start = time.perf_counter()
    r = run_cli(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    for word in words:
        assert word in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []  # no run folder, no file
    assert time.perf_counter() - start < 60


@pytest.mark.parametrize(
    "flag, value", [("--headroom", "20"), ("--max-compiles", "3"), ("--fit-minutes", "5")]
)
def test_a_fit_flag_without_fit_is_refused(flag, value, capsys):
    """The fit search's own flags, given without --fit, would be ignored: refused, naming the flag
    (before any config or backend loads)."""
    assert cli.main(["memory", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag}=" in err and "add --fit" in err and "Traceback" not in err


def test_memory_plot_without_an_accelerator_target_is_refused(tmp_path, capsys, monkeypatch):
    """memory --plot draws the step time predicted for a TPU or GPU target: on the CPU target
    (the default) it would compile and draw nothing, so it is refused before the config loads."""
    from expertax.cli import memory

    monkeypatch.setattr(memory, "config_from_args", lambda _: pytest.fail("the config loaded"))
    assert cli.main(["memory", "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot=" in err and "not --target=cpu" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
