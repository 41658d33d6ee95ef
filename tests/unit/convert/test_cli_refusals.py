"""`expertax convert`'s refusals before any work: a to-hf flag given to from-hf (it would do
nothing), an OUT_DIR that is the input, inside it, around it or cannot be written, and a tensor
shape that a field config.json left out explains (named, with the default it was read as)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expertax import startup
from expertax.cli import main
from expertax.config import ConfigError
from expertax.convert import convert_from_hf, write_hf
from expertax.preflight import load_config
from tests.unit.convert.hub import random_params
from tests.unit.convert.test_tokenizer_files import TINY


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--max-shard-bytes", "1000"], "--max-shard-bytes is an option of to-hf"),
        (["--fp8"], "--fp8 is an option of to-hf"),
        ([], "OUT_DIR='/proc/out': nothing can be written in '/proc'"),
    ],
)
def test_from_hf_refuses_before_any_backend_starts(argv, words, tmp_path, monkeypatch, capsys):
    (tmp_path / "hf").mkdir()
    out = "/proc/out" if not argv else str(tmp_path / "out")
    monkeypatch.setattr(startup, "start_backends", lambda: pytest.fail("a backend started"))
    assert main(["convert", "from-hf", str(tmp_path / "hf"), out, *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_shape_a_missing_field_explains_names_the_field(tmp_path):
    """config.json without hidden_size: transformers' default (4096 for Mixtral) is read, and the
    first tensor of another shape is refused naming the missing field and that default."""
    c = load_config(overrides=TINY)
    hf = tmp_path / "hf"
    write_hf(random_params(c, 0), c, hf)
    config = json.loads((hf / "config.json").read_text())
    del config["hidden_size"]
    Path(hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        convert_from_hf(hf, tmp_path / "model")
    assert "the config implies" in str(e.value)
    assert "config.json lacks hidden_size (taken as 4096)" in str(e.value), str(e.value)
    assert not (tmp_path / "model").exists()
