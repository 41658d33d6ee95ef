"""A saved config.yml that is damaged, empty or someone else's is named as such, never read as the
built-in defaults: in a run folder, a model directory, a run folder given to convert or generate.
A run folder that never trained a step is started again with the new config; one that trained
keeps its protection."""

from __future__ import annotations

import json
import re

import pytest
from tests.conftest import TINY_MOE

from expertax.config import ConfigError
from expertax.config.loader import config_to_yaml
from expertax.preflight import load_config
from expertax.train import checkpoint, config_file, model_dir, params_io, run_dir

KINDS = [
    "empty", "blank lines", "a comment only", "not YAML", "not UTF-8", "a list",
    "another program's", "cut off",
]  # fmt: skip


def config(out, **overrides):
    keys = {**TINY_MOE, "base_output_directory": str(out), "run_name": "r"}
    return load_config(overrides={**keys, **overrides})


def good_text(tmp_path) -> str:
    return config_to_yaml(config(tmp_path))


def damaged_texts(tmp_path) -> dict[str, tuple[str | bytes, str]]:
    """Kind -> (the file's content, a pattern of what the refusal says is wrong)."""
    good = good_text(tmp_path)
    cut = good.index("\n", len(good) // 2) - 2  # inside a line, as a crash mid-write leaves it
    return {
        "empty": ("", "is empty"),
        "blank lines": ("\n\n", "is empty"),
        "a comment only": ("# nothing here\n", "is empty"),
        "not YAML": ("model_name: [mixtral\n", r"is damaged \(not valid YAML\)"),
        "not UTF-8": (b"\xff\xfemodel_name: x\n", r"is damaged \(not UTF-8"),
        "a list": ("- a\n- b\n", "is not an expertax config"),
        "another program's": ("name: web\nreplicas: 3\n", "is not an expertax config"),
        "cut off": (good[:cut], "is damaged"),
    }


def write(path, content: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


def test_damaged_kinds_are_named_and_a_written_config_is_not(tmp_path):
    texts = damaged_texts(tmp_path)
    assert list(texts) == KINDS
    for kind, (content, pattern) in texts.items():
        write(tmp_path / kind / "config.yml", content)
        wrong = config_file.read(tmp_path / kind / "config.yml")[1]
        assert wrong is not None and re.search(pattern, wrong), (kind, wrong)
    write(tmp_path / "good" / "config.yml", good_text(tmp_path))
    assert config_file.read(tmp_path / "good" / "config.yml")[1] is None  # negative control
    assert config_file.read_saved(tmp_path / "good" / "config.yml", "")["base_emb_dim"] == 64


@pytest.mark.parametrize("kind", KINDS)
def test_a_trained_run_folder_with_a_damaged_config_is_refused_naming_the_file(kind, tmp_path):
    content, pattern = damaged_texts(tmp_path)[kind]
    folder = tmp_path / "r"
    write(folder / "config.yml", content)
    (folder / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    with pytest.raises(ConfigError, match=pattern) as err:
        run_dir.inspect(config(tmp_path))
    message = str(err.value)
    assert str(folder / "config.yml") in message and "choose another run_name" in message
    assert "base_emb_dim" not in message  # not a list of keys "changed" from the defaults
    assert sorted(p.name for p in folder.iterdir()) == ["config.yml", "metrics.jsonl"]


def test_a_run_folder_that_never_trained_is_started_again(tmp_path):
    folder = tmp_path / "r"
    checkpoint.mark_directory(folder / "checkpoints")  # what a run refused after its write left
    write(folder / "config.yml", config_to_yaml(config(tmp_path, base_emb_dim=32)))
    (folder / "metrics.jsonl").write_text("")  # opened, no step recorded
    plan = run_dir.inspect(config(tmp_path))
    assert plan.replaced and plan.resume_step is None
    write(folder / "config.yml", "")  # a damaged config.yml protects nothing either
    assert run_dir.inspect(config(tmp_path)).replaced
    # Negative controls: the same config is no replacement; a step recorded (here in a file set
    # aside by a restart) means the folder trained, and keeps today's refusal.
    write(folder / "config.yml", good_text(tmp_path))
    assert not run_dir.inspect(config(tmp_path)).replaced
    (folder / "metrics.jsonl.1").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    with pytest.raises(ConfigError, match="base_emb_dim: 64 -> 32"):
        run_dir.inspect(config(tmp_path, base_emb_dim=32))


def test_model_and_run_folders_with_a_damaged_config_are_named(tmp_path):
    model = tmp_path / "model"
    write(model / "config.yml", "")
    model_dir.write_marker(model, source="test")
    with pytest.raises(ConfigError, match=r"model/config.yml is empty; convert the model again"):
        model_dir.read_config(model)
    write(tmp_path / "run" / "config.yml", "name: web\n")
    with pytest.raises(ConfigError, match=r"run/config.yml is not an expertax config"):
        params_io.read_run_config(tmp_path / "run")
    write(tmp_path / "run" / "config.yml", good_text(tmp_path))  # negative control
    assert params_io.read_run_config(tmp_path / "run").base_emb_dim == 64


def test_a_resumed_run_with_damaged_metrics_is_refused_before_anything_compiles(
    tmp_path, monkeypatch
):
    """A run to resume (a complete checkpoint) whose metrics.jsonl is not UTF-8 text is named by
    `inspect`, before the step compiles (it failed after the compile, trimming the file)."""
    folder = tmp_path / "r"
    checkpoint.mark_directory(folder / "checkpoints")
    write(folder / "config.yml", good_text(tmp_path))
    write(folder / "metrics.jsonl", b'{"step": 0}\n\x8e\x00\n')
    monkeypatch.setattr(checkpoint, "latest_intact_step", lambda _: (2, {}))
    with pytest.raises(ConfigError, match=r"metrics.jsonl is not UTF-8 text \(byte 0x8e at offs"):
        run_dir.inspect(config(tmp_path))
    write(folder / "metrics.jsonl", '{"step": 0, "loss": 1.0}\n')  # negative control
    assert run_dir.inspect(config(tmp_path)).resume_step == 2


def test_a_run_folder_with_a_damaged_checkpoint_marker_is_named(tmp_path):
    """generate and convert read a run folder's marker whole: one cut short is named (it was
    passed over and the run read as if nothing were wrong)."""
    folder = tmp_path / "run"
    write(folder / "config.yml", good_text(tmp_path))
    write(folder / "checkpoints" / checkpoint.MARKER_FILE, '{"x": ')
    with pytest.raises(ConfigError, match="expertax_checkpoints.json is damaged"):
        params_io.read_run_config(folder)
