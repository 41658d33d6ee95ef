"""Damaged safetensors files and index files: a ConfigError naming the file and what is wrong,
before anything is converted (and through the CLI, one line and exit status 2, no traceback)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from expertax.cli import main
from expertax.config import ConfigError
from expertax.convert import safetensors_io

ENTRIES = [("a", (2, 3), np.dtype(np.float32)), ("b", (4,), np.dtype(np.int32))]


def good_file(folder) -> bytes:
    """A valid model.safetensors of ENTRIES in `folder`; returns its bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    values = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int32)}
    path = folder / safetensors_io.SINGLE_FILE
    safetensors_io.write_file(path, ENTRIES, values.items())
    return path.read_bytes()


def with_header(raw: bytes, header: object) -> bytes:
    """`raw` with its JSON header replaced by `header` (the tensors' bytes kept)."""
    (length,) = struct.unpack("<Q", raw[:8])
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + raw[8 + length :]


def damaged(raw: bytes) -> dict[str, tuple[bytes, str]]:
    """Kind -> (the file's bytes, a pattern of the refusal)."""
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    no_dtype = {**header, "a": {k: v for k, v in header["a"].items() if k != "dtype"}}
    return {
        "shorter than its length field": (raw[:5], "not a safetensors file: 5 bytes"),
        "a length past the end": (struct.pack("<Q", 10**9) + raw[8:], "length field says"),
        "a header that is not JSON": (raw[:8] + b"{" * length + raw[8 + length :], "not JSON"),
        "a header that is a list": (with_header(raw, [1, 2]), "not a JSON object"),
        "an entry without a dtype": (with_header(raw, no_dtype), "entry of tensor 'a'"),
        "cut off inside a tensor": (raw[:-4], "is cut off: tensor b ends at byte"),
    }


KINDS = [
    "shorter than its length field", "a length past the end", "a header that is not JSON",
    "a header that is a list", "an entry without a dtype", "cut off inside a tensor",
]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_file_is_named_with_what_is_wrong(kind, tmp_path):
    raw = good_file(tmp_path / "good")
    with safetensors_io.Reader(tmp_path / "good") as reader:  # negative control
        assert reader.names() == ["a", "b"] and reader.get("b").tolist() == [0, 1, 2, 3]
    content, pattern = damaged(raw)[kind]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / safetensors_io.SINGLE_FILE).write_bytes(content)
    with pytest.raises(ConfigError, match=pattern) as err:
        safetensors_io.Reader(tmp_path / "bad")
    assert str(tmp_path / "bad" / safetensors_io.SINGLE_FILE) in str(err.value)


def test_a_damaged_index_is_named(tmp_path):
    good_file(tmp_path)
    index = tmp_path / safetensors_io.INDEX_FILE
    for content in ("{not json", '{"metadata": {}}', '{"weight_map": ["a"]}'):
        index.write_text(content)
        with pytest.raises(ConfigError, match=f"{index} is damaged"):
            safetensors_io.Reader(tmp_path)
    index.write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model.safetensors"}})
    )
    with safetensors_io.Reader(tmp_path) as reader:  # negative control
        assert reader.names() == ["a", "b"]


def test_convert_of_a_damaged_checkpoint_is_one_line_and_writes_nothing(tmp_path, capsys):
    raw = good_file(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    (tmp_path / "hf" / safetensors_io.SINGLE_FILE).write_bytes(raw[:-4])
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{tmp_path / 'hf' / safetensors_io.SINGLE_FILE} is cut off" in err
    assert not (tmp_path / "out").exists()
    (tmp_path / "hf" / "config.json").write_text("{model_type")  # a damaged config.json
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'hf' / 'config.json'} is damaged" in capsys.readouterr().err
