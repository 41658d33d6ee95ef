"""No user file replaced unasked (expertax/outputs.py): every command's output flag refuses an
existing file before any work, leaving its bytes as they were, and takes it with --overwrite; the
output's folder must exist, be a folder and take new files; an existing output must be a regular
file; `report --out` must name a folder. No output lands on another output of the same command,
on one of its inputs or inside an input folder, --overwrite or not (`check_apart`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from expertax import startup
from expertax.cli import main, memory, parity
from expertax.tools import bench_gmm, bench_gmm_target
from expertax.tools import report as report_tool

KEPT = b'{"the user\'s": "file"}\n'

# (the command line without its output, the output flag, the user error the command stops at next
# once the output is taken: each command then refuses something else, so nothing runs)
FILE_OUTPUTS = [
    pytest.param(
        ["generate", "{tmp}/no_run", "--prompt-ids", "1"], "--json", "does not exist", id="generate"
    ),
    pytest.param(["memory", "no_such_key=1"], "--json", "no_such_key", id="memory"),
    pytest.param(["memory", "--fit", "no_such_key=1"], "--json", "no_such_key", id="memory-fit"),
    pytest.param(["parity", "no_such_key=1"], "--json", "no_such_key", id="parity"),
    pytest.param(
        ["parity", "--compile-only", "--steps", "3"],
        "--json",
        "cannot be honoured with --compile-only",
        id="parity-compile-only",
    ),
    pytest.param(["bench", "gmm", "--backends", "nosuch"], "--json", "--backends", id="bench"),
    pytest.param(
        ["bench", "gmm", "--backends", "nosuch"], "--markdown", "--backends", id="bench-markdown"
    ),
    pytest.param(
        ["bench", "gmm", "--target", "cpu"], "--json", "the CPU grid is timed", id="bench-target"
    ),
    pytest.param(
        ["bench", "gmm", "--target", "cpu"],
        "--markdown",
        "the CPU grid is timed",
        id="bench-target-markdown",
    ),
    pytest.param(
        ["steptime", "{tmp}/none.hlo", "--target", "gpu:h100x8"],
        "--json",
        "does not exist",
        id="steptime",
    ),
]


def _forbid_work(monkeypatch) -> None:
    """Loading a config, starting a backend, measuring or compiling fails the test."""

    def began(*args, **kwargs):
        raise AssertionError("work began before the output was checked")

    monkeypatch.setattr(startup, "start_backends", began)
    for module in (memory, parity):
        monkeypatch.setattr(module, "config_from_args", began)
    monkeypatch.setattr(bench_gmm, "run_grid", began)
    monkeypatch.setattr(bench_gmm_target, "_run", began)
    monkeypatch.setattr(report_tool, "read_run", began)


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of `expertax ARGV` in this process; a user error is one line."""
    rc = main(argv)
    err = capsys.readouterr().err
    if rc == 2:
        assert err.startswith("expertax: error: ") and err.count("\n") == 1, err
    return rc, err


def _command(argv: list[str], tmp_path) -> list[str]:
    return [a.format(tmp=tmp_path) for a in argv]


@pytest.mark.parametrize("argv, flag, _next", FILE_OUTPUTS)
def test_an_existing_output_is_refused_before_any_work(
    argv, flag, _next, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "out.json"
    out.write_bytes(KEPT)
    _forbid_work(monkeypatch)
    rc, err = _run(capsys, [*_command(argv, tmp_path), flag, str(out)])
    assert rc == 2
    assert f"{flag}={str(out)!r} exists already: add --overwrite to replace it" in err
    assert "or give another path" in err
    assert out.read_bytes() == KEPT


@pytest.mark.parametrize("argv, flag, next_error", FILE_OUTPUTS)
def test_overwrite_takes_an_existing_output(argv, flag, next_error, tmp_path, capsys):
    """With --overwrite the command goes on, to the next thing it refuses (not the output)."""
    out = tmp_path / "out.json"
    out.write_bytes(KEPT)
    rc, err = _run(capsys, [*_command(argv, tmp_path), flag, str(out), "--overwrite"])
    assert rc == 2 and next_error in err and "exists already" not in err, err
    assert out.read_bytes() == KEPT  # stopped before writing anything


@pytest.mark.parametrize("argv, flag, _next", FILE_OUTPUTS)
def test_an_output_in_a_missing_folder_or_a_file_is_refused(
    argv, flag, _next, tmp_path, monkeypatch, capsys
):
    _forbid_work(monkeypatch)
    command = _command(argv, tmp_path)
    missing = tmp_path / "no" / "out.json"
    rc, err = _run(capsys, [*command, flag, str(missing), "--overwrite"])
    assert rc == 2 and f"its folder {str(missing.parent)!r} does not exist; create it" in err
    (tmp_path / "file").write_bytes(KEPT)
    rc, err = _run(capsys, [*command, flag, str(tmp_path / "file" / "out.json")])
    assert rc == 2 and f"its folder {str(tmp_path / 'file')!r} is not a folder" in err
    rc, err = _run(capsys, [*command, flag, str(tmp_path)])
    assert rc == 2 and f"{flag}={str(tmp_path)!r} is a folder; give a file path" in err


def test_a_new_output_file_is_taken_without_overwrite(tmp_path, capsys):
    """Negative control of the refusal: a path that does not exist yet goes through."""
    out = tmp_path / "new.json"
    rc, err = _run(capsys, ["memory", "no_such_key=1", "--json", str(out)])
    assert rc == 2 and "no_such_key" in err and "--json" not in err


@pytest.fixture
def run_dir(tmp_path):
    """A run folder as training writes it, three steps, the last one's loss not finite (null)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yml").write_text("run_name: run\nmodel_name: tiny\nsteps: 3\n")
    speed = '"step_time_s": 0.5, "tokens_per_s_per_device": 100.0'
    lines = [f'{{"step": {s}, "loss": {loss}, {speed}}}' for s, loss in enumerate([3, 2.5, "null"])]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_report_out_holding_a_report_is_refused_unless_overwrite(run_dir, tmp_path, capsys):
    out = tmp_path / "site"
    out.mkdir()
    (out / "index.html").write_bytes(KEPT)
    with pytest.MonkeyPatch.context() as patch:
        _forbid_work(patch)
        rc, err = _run(capsys, ["report", str(run_dir), "--out", str(out)])
    assert rc == 2 and f"--out={str(out)!r} holds index.html already: add --overwrite" in err
    assert (out / "index.html").read_bytes() == KEPT and sorted(out.iterdir()) == [
        out / "index.html"
    ]
    assert main(["report", str(run_dir), "--out", str(out), "--overwrite"]) == 0
    page = (out / "index.html").read_text()
    assert page.startswith("<!doctype html>") and (out / "loss.png").stat().st_size > 1000
    # the last step's null loss is reported as not finite, the first as written
    assert "<th>final loss</th><td>nan</td>" in page and "<th>first loss</th><td>3</td>" in page


def test_report_out_folders_taken_and_refused(run_dir, tmp_path, capsys):
    # a folder without the report's files is taken as it is, its own files kept
    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.txt").write_bytes(KEPT)
    assert main(["report", str(run_dir), "--out", str(other)]) == 0
    assert (other / "notes.txt").read_bytes() == KEPT and (other / "index.html").is_file()
    # the default folder, RUN_DIR/report, is the report's own: rewritten each time
    assert main(["report", str(run_dir)]) == main(["report", str(run_dir)]) == 0
    capsys.readouterr()
    # --out naming a file, or a folder below a file
    (tmp_path / "file").write_bytes(KEPT)
    rc, err = _run(capsys, ["report", str(run_dir), "--out", str(tmp_path / "file")])
    assert rc == 2 and "is a file; give a folder" in err
    below = tmp_path / "file" / "site"
    rc, err = _run(capsys, ["report", str(run_dir), "--out", str(below)])
    assert rc == 2 and f"its folder {str(tmp_path / 'file')!r} is not a folder" in err
    assert (tmp_path / "file").read_bytes() == KEPT


def test_every_command_writing_a_named_file_has_overwrite():
    """The table's commands are those with an output flag: each has --overwrite (bench in the
    parsers of its benchmark, which reads its own flags)."""
    from expertax.cli.parser import build_parser

    _, subs = build_parser()
    with_flag = {name for name, p in subs.items() if "--overwrite" in p.format_help()}
    assert with_flag == {"generate", "memory", "parity", "report", "steptime"}
    for parser in (bench_gmm._parser(), bench_gmm_target._parser()):
        assert "--overwrite" in parser.format_help()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("argv, flag, _next", FILE_OUTPUTS)
def test_an_output_that_cannot_be_written_is_refused_before_any_work(
    argv, flag, _next, tmp_path, monkeypatch, capsys
):
    """A folder nothing can be made in (/proc stands for a read-only or another user's folder)
    and an existing output that is not a regular file (/dev/null) are refused, --overwrite or
    not: the command would fail after its work, or write nowhere."""
    _forbid_work(monkeypatch)
    command = _command(argv, tmp_path)
    rc, err = _run(capsys, [*command, flag, "/proc/out.json", "--overwrite"])
    assert rc == 2 and f"{flag}='/proc/out.json': nothing can be written in '/proc'" in err
    rc, err = _run(capsys, [*command, flag, os.devnull, "--overwrite"])
    assert rc == 2 and f"{flag}={os.devnull!r} is a character device, not a file" in err


# (the command line, with {tmp} the test's folder, and the words of its refusal): each names an
# output on another output's path, on an input's, inside an input folder or (OUT_DIR) around it
APART = [
    (["steptime", "{tmp}/p.hlo", "--json", "{tmp}/p.hlo"], "--json='{tmp}/p.hlo' is PROGRAM"),
    (
        ["steptime", "{tmp}/p.hlo", "--plot", "{tmp}/p.hlo.meta.json"],
        "is PROGRAM.meta.json '{tmp}/p.hlo.meta.json'",
    ),
    (
        ["steptime", "{tmp}/p.hlo", "--json", "{tmp}/s.svg", "--plot", "{tmp}/s.svg"],
        "--json='{tmp}/s.svg' and --plot='{tmp}/s.svg' are the same file",
    ),
    (["memory", "--json", "{tmp}/m", "--save-program", "{tmp}/m"], "are the same file"),
    (
        ["memory", "--json", "{tmp}/m.meta.json", "--save-program", "{tmp}/m"],
        "and --save-program's .meta.json='{tmp}/m.meta.json' are the same file",
    ),
    (["memory", "{tmp}/c.yml", "--json", "{tmp}/c.yml"], "is the config file '{tmp}/c.yml'"),
    (["parity", "{tmp}/c.yml", "--json", "{tmp}/c.yml"], "is the config file '{tmp}/c.yml'"),
    (
        ["generate", "{tmp}/run", "--prompt-ids", "1", "--json", "{tmp}/run/config.yml"],
        "--json='{tmp}/run/config.yml' is inside SOURCE '{tmp}/run'",
    ),
    (
        ["generate", "{tmp}/run", "--prompts-file", "{tmp}/b.json", "--json", "{tmp}/b.json"],
        "is --prompts-file '{tmp}/b.json'",
    ),
    (
        ["bench", "gmm", "--from-json", "{tmp}/b.json", "--markdown", "{tmp}/b.json"],
        "--markdown='{tmp}/b.json' is --from-json '{tmp}/b.json'",
    ),
    (
        ["bench", "gmm", "--json", "{tmp}/o", "--markdown", "{tmp}/o"],
        "--json='{tmp}/o' and --markdown='{tmp}/o' are the same file",
    ),
    (
        ["bench", "gmm", "--target", "gpu:h100x8", "--from-json", "{tmp}/o,{tmp}/b.json"]
        + ["--markdown", "{tmp}/b.json"],
        "is --from-json '{tmp}/b.json'",
    ),
    (["report", "{tmp}/run", "--out", "{tmp}/run"], "--out='{tmp}/run' is RUN_DIR '{tmp}/run'"),
    (
        ["report", "{tmp}/run", "--out", "{tmp}/run/checkpoints"],
        "--out='{tmp}/run/checkpoints' is inside RUN_DIR '{tmp}/run'",
    ),
    (["convert", "from-hf", "{tmp}/hf", "{tmp}/hf"], "OUT_DIR='{tmp}/hf' is HF_DIR '{tmp}/hf'"),
    (["convert", "from-hf", "{tmp}/hf", "{tmp}/hf/sub"], "is inside HF_DIR '{tmp}/hf'"),
    (["convert", "from-hf", "{tmp}/hf", "{tmp}"], "OUT_DIR='{tmp}' holds HF_DIR '{tmp}/hf'"),
    (
        ["convert", "to-hf", "{tmp}/run", "{tmp}/run/checkpoints/99"],
        "OUT_DIR='{tmp}/run/checkpoints/99' is inside CKPT_DIR '{tmp}/run'",
    ),
]


def _inputs(tmp_path: Path) -> None:
    """The inputs APART's commands name: a program and its facts, a preset, a run folder with a
    checkpoint folder, an HF folder and a benchmark's JSON."""
    (tmp_path / "p.hlo").write_bytes(KEPT)
    (tmp_path / "p.hlo.meta.json").write_bytes(KEPT)
    (tmp_path / "c.yml").write_text("steps: 3\n")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "config.yml").write_text("steps: 3\n")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_bytes(KEPT)
    (tmp_path / "b.json").write_bytes(KEPT)


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("argv, words", APART)
def test_an_output_on_an_input_or_on_another_output_is_refused(
    argv, words, tmp_path, monkeypatch, capsys
):
    """Refused before any work even with --overwrite, naming both paths; nothing changed."""
    _inputs(tmp_path)
    _forbid_work(monkeypatch)
    before = _tree(tmp_path)
    overwrite = [] if argv[0] == "convert" else ["--overwrite"]  # convert has no such flag
    rc, err = _run(capsys, [*_command(argv, tmp_path), *overwrite])
    assert rc == 2 and words.format(tmp=tmp_path) in err, err
    assert "nothing was done" in err
    assert _tree(tmp_path) == before


def test_the_apart_rule_takes_separate_paths():
    """Negative control: outputs beside their inputs, in other folders, and the report's own
    folder inside its run folder pass."""
    from expertax.outputs import check_apart

    check_apart({"--json": "a/x.json", "--plot": "a/x.png"}, {"PROGRAM": "a/x.hlo"})
    check_apart({"OUT_DIR": "out/hf"}, {"HF_DIR": "in/hf"}, around_inputs=True)
    check_apart({"--json": None, "--plot": ""}, {"PROGRAM": "x"})  # not asked for; empty: later
