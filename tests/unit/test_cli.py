"""Command-line parsing: flags and key=value overrides in any order, on every subcommand."""

from __future__ import annotations

import pytest

from expertax.cli.parser import parse_args
from expertax.cli.train import help_keys
from expertax.config.schema import KINDS, Config


@pytest.mark.parametrize(
    "argv, flag, value",
    [
        (["memory", "model_name=x", "--devices", "128", "--hbm", "141", "a=1"], "hbm", 141.0),
        (["memory", "--hbm", "141", "a=1", "--devices", "8", "b=2"], "devices", 8),
        (["parity", "--steps", "3", "a=1", "p.yml", "--json", "o.json", "b=2"], "steps", 3),
        (["train", "a=1", "--help-keys", "b=2"], "help_keys", True),
    ],
)
def test_flags_and_overrides_in_any_order(argv, flag, value):
    args = parse_args(argv)
    assert args.command == argv[0]
    assert getattr(args, flag) == value
    assert [a for a in args.config if "=" in a] == [a for a in argv if "=" in a]


def test_bench_passes_its_flags_through():
    args = parse_args(["bench", "gmm", "--quick", "--json", "x.json"])
    assert args.command == "bench" and args.rest == ["--quick", "--json", "x.json"]


def test_an_unknown_flag_is_still_an_error():
    with pytest.raises(SystemExit) as e:
        parse_args(["memory", "a=1", "--no-such-flag"])
    assert e.value.code == 2


def test_a_flags_value_may_start_with_a_dash():
    """`--prompt-ids -1,2` gives the flag its value (argparse alone answers "expected one
    argument"), for the flag's own check to refuse by its rule; a flag after a flag is still a
    missing value."""
    args = parse_args(["generate", "run", "--prompt-ids", "-1,2", "--prompt", "-x y"])
    assert args.prompts == [("ids", "-1,2"), ("text", "-x y")]
    assert parse_args(["memory", "--hbm", "-4"]).hbm == -4.0  # a negative number, as before
    with pytest.raises(SystemExit) as e:
        parse_args(["generate", "run", "--json", "--overwrite"])
    assert e.value.code == 2


def test_parity_refuses_run_keys_and_names_its_layouts_value(capsys):
    """parity trains no run: a run key given as key=value (steps=, base_output_directory=) would
    do nothing and is refused naming it; an empty entry of --layouts names the value given."""
    from expertax.cli import main

    for argv, words in (
        (["parity", "steps=5"], "steps=5 is a run key, which parity does not read"),
        (["parity", "base_output_directory=/dev/null"], "base_output_directory='/dev/null'"),
        (["parity", "--layouts", "sparse-ring-ep8,", "--compile-only"], "--layouts='sparse-ring"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_help_keys_names_every_key_with_its_kind():
    text = help_keys()
    for key in Config.model_fields:
        line = next(line for line in text.splitlines() if line.startswith(f"  {key} = "))
        assert any(f"({kind}" in line for kind in KINDS), line


def test_help_keys_shows_the_default_run_and_the_schema_where_the_preset_differs():
    """The default is what `expertax train` with no arguments runs (the default model_name's
    preset over the schema); a key the preset sets names the schema's default too; negative
    control: a key the preset leaves shows its one default, unlabelled."""
    from expertax.config.loader import load_fields

    runs = load_fields()
    lines = {line.split(" = ")[0].strip(): line for line in help_keys().splitlines()}
    differ = [k for k, f in Config.model_fields.items() if getattr(runs, k) != f.default]
    assert "shared_experts" in differ and "attention_type" in differ  # tiny DeepSeek-V3
    for key, field in Config.model_fields.items():
        line = lines[key]
        assert line.startswith(f"  {key} = {getattr(runs, key)!r} ("), line
        label = f"; {runs.model_name} preset; schema default {field.default!r}):"
        assert (label in line) == (key in differ), line
    assert "'mla' (model; deepseek3-tiny preset; schema default 'gqa'):" in lines["attention_type"]
    assert lines["vocab_size"].startswith(f"  vocab_size = {runs.vocab_size} (model): ")
