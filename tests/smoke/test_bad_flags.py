"""Every command's flags, walked from the argument parser: a bad value (not a number, inf, nan,
past its limit, outside its choices) ends the command with a non-zero status and one message
naming the flag, before any work and without a traceback. In-process through `expertax.cli.main`
(a process per flag would take minutes); a few cases run as a user runs them."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from expertax import cli
from expertax.cli import parser as cli_parser
from expertax.tools import bench_gmm

# What each command needs besides the flag to reach its flags' checks.
POSITIONALS = {
    "generate": ["SOURCE"],
    "convert": ["from-hf", "HF_DIR", "OUT_DIR"],
    "report": ["RUN"],
}
NUMERIC = (int, float)
# Text flags checked before the command's work, with a value each refuses.
TEXT_CASES = [
    ("memory", "--target", "tpu:v9-8"),
    ("memory", "--target", "gpu:h100x12"),
    ("parity", "--target", "cpu"),  # parity trains here: --target needs --compile-only
    ("parity", "--layouts", "sparse-bogus-ep2"),
    ("parity", "--layouts", "sparse-ragged-ep8"),  # XLA:CPU has no ragged all-to-all
    ("generate", "--prompts-file", "/no/such/prompts.jsonl"),
    ("generate", "--json", "/no/such/folder/out.json"),
]


def _flag_actions(parser):
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def _subparsers():
    _, subs = cli_parser.build_parser()
    return subs


def bad_values(action, limit) -> list[str]:
    """The values of a flag that must be refused."""
    if action.choices is not None:
        return ["no-such-choice"]
    if action.type not in NUMERIC:
        return []
    values = ["many", "inf", "nan", "-inf"]
    if limit is not None:
        values.append(str(limit.low if limit.low_open else limit.low - 1))
        if not math.isinf(limit.high):
            values.append(str(limit.high if limit.high_open else limit.high + 1))
    if action.type is int:
        values.append("1.5")
    return values


def flag_cases() -> list[tuple[str, str, str]]:
    """(command, flag, bad value) for every flag of every command (bench's own parser too)."""
    cases = []
    for name, sub in _subparsers().items():
        limits = cli_parser.COMMANDS[name].LIMITS
        for action in _flag_actions(sub):
            flag = max(action.option_strings, key=len)
            for value in bad_values(action, limits.get(flag)):
                cases.append((name, flag, value))
    cases += TEXT_CASES
    for action in _flag_actions(bench_gmm._parser()):
        flag = max(action.option_strings, key=len)
        if action.type in NUMERIC:
            cases += [("bench", flag, v) for v in ("many", "-1", "nan", "inf")]
    return cases


def test_every_numeric_flag_has_a_limit_of_its_type():
    for name, sub in _subparsers().items():
        limits = cli_parser.COMMANDS[name].LIMITS
        numeric = {
            max(a.option_strings, key=len): a.type for a in _flag_actions(sub) if a.type in NUMERIC
        }
        assert set(numeric) == set(limits), name
        for flag, kind in numeric.items():
            assert limits[flag].integer == (kind is int), flag


CASES = flag_cases()


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code if isinstance(e.code, int) else 1
    return rc, capsys.readouterr().err


def test_every_bad_flag_value_is_refused_naming_the_flag(capsys):
    assert len(CASES) > 80
    for command, flag, value in CASES:
        head = ["bench", "gmm"] if command == "bench" else [command, *POSITIONALS.get(command, [])]
        rc, err = _run([*head, f"{flag}={value}"], capsys)
        assert rc != 0, (command, flag, value)
        assert flag in err and "Traceback" not in err, (command, flag, value, err)


def test_good_flag_values_pass_the_limits():
    """Negative control: each limit takes its own low end (or just above it) and a middle value."""
    for name in _subparsers():
        for flag, limit in cli_parser.COMMANDS[name].LIMITS.items():
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
