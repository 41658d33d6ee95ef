"""Streamed HF conversion without torch: fp8 DeepSeek-V3 checkpoints (with a multi-token-
prediction layer), refusals, kill and resume, row blocks, the progress line (issue 16)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import expertax
from expertax.convert import (
    ConversionError,
    config_from_hf,
    convert_from_hf,
    convert_to_hf,
    hf_read,
    hf_write,
)
from expertax.convert.progress import PROGRESS_ENV, Progress
from expertax.convert.safetensors_io import Reader, iter_tensors
from expertax.train import model_dir
from tests.unit.convert.hub import FP8, HUB_QC, MTP_LAYER

# the MTP layer's copies of the embedding and output head: checked on reading, not converted
SHARED = {f"model.layers.{MTP_LAYER}.{n}.weight" for n in ("embed_tokens", "shared_head.head")}


def _leaves(path: Path) -> dict[str, bytes]:
    _, params, _ = model_dir.load(path)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {".".join(k.name for k in p): np.asarray(x).tobytes() for p, x in flat}


def test_fp8_checkpoint_equals_its_reference_dequantization(checkpoints, tmp_path):
    root = checkpoints
    ours = convert_from_hf(root / "hub", tmp_path / "hub")
    ref = convert_from_hf(root / "deq", tmp_path / "deq")
    assert ours.config.mtp_num_layers == ref.config.mtp_num_layers == 1
    assert ours.notes == ref.notes == []
    a, b = _leaves(tmp_path / "hub"), _leaves(tmp_path / "deq")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]
    assert "mtp.block.moe.wi_0" in a and "mtp.eh_proj" in a
    # logits equal too (same bytes, same program)
    c, p_hub, _ = model_dir.load(tmp_path / "hub")
    _, p_ref, _ = model_dir.load(tmp_path / "deq")
    tokens = np.arange(32, dtype=np.int32).reshape(1, 32) % c.vocab_size
    np.testing.assert_array_equal(
        np.asarray(expertax.logits(p_hub, tokens, c)), np.asarray(expertax.logits(p_ref, tokens, c))
    )
    # negative control: one block's scale 1 % off changes that leaf (and only that one)
    bad = root / "bad"
    bad.mkdir(exist_ok=True)
    tensors = dict(iter_tensors(root / "hub"))
    name = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
    tensors[name] = tensors[name] * np.float32(1.01)
    save_file(tensors, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((root / "hub" / "config.json").read_text())
    convert_from_hf(bad, tmp_path / "bad")
    diff = [k for k, v in _leaves(tmp_path / "bad").items() if v != a[k]]
    assert diff == ["moe_layers.moe.wi_1"]


def test_fp8_round_trip_is_exact(checkpoints, tmp_path):
    """Every tensor back bit for bit, the MTP layer's (fp8 block weights, bfloat16 eh_proj) and
    its shared copies included."""
    root = checkpoints
    convert_from_hf(root / "hub", tmp_path / "ours")
    convert_to_hf(tmp_path / "ours", tmp_path / "back", use_fp8=True, max_shard_bytes=2**20)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["quantization_config"] == HUB_QC
    assert back["num_nextn_predict_layers"] == 1
    source = dict(iter_tensors(root / "hub"))
    assert f"model.layers.{MTP_LAYER}.self_attn.q_b_proj.weight_scale_inv" in source
    assert SHARED <= source.keys()
    written = dict(iter_tensors(tmp_path / "back"))
    assert written.keys() == source.keys()
    for name, w in source.items():
        assert written[name].dtype == w.dtype and written[name].tobytes() == w.tobytes(), name
    # without the kept scales (a model trained since, say): amax / 448 per block, still fp8
    (tmp_path / "ours" / model_dir.FP8_SCALES).unlink()
    convert_to_hf(tmp_path / "ours", tmp_path / "fresh", use_fp8=True)
    with Reader(tmp_path / "fresh") as r:
        name = "model.layers.1.mlp.experts.0.gate_proj.weight"
        assert r.dtype(name) == np.dtype(FP8) and r.shape(name + "_scale_inv") == (2, 2)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"fmt": "e5m2"}, "quantization_config.fmt='e5m2'"),
        ({"weight_block_size": [64, 64]}, "quantization_config.weight_block_size=[64, 64]"),
        ({"quant_method": "gptq"}, "quantization_config.quant_method='gptq'"),
        ({"bits": 4}, "quantization_config.bits=4"),
    ],
)
def test_other_quantization_configs_are_refused(change, field):
    from expertax.convert.hf_config import _HF_DEFAULTS

    base = {**_HF_DEFAULTS["deepseek_v3"], "model_type": "deepseek_v3"}
    config_from_hf({**base, "quantization_config": HUB_QC})  # control: the hub's is accepted
    with pytest.raises(ConversionError, match=field.replace("[", r"\[").replace("]", r"\]")):
        config_from_hf({**base, "quantization_config": {**HUB_QC, **change}})


def _cli(*args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(Path(expertax.__file__).parents[1]), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "expertax.cli", "convert", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_killed_conversion_resumes_without_redoing_work(checkpoints, tmp_path):
    root = checkpoints
    out = tmp_path / "killed"
    r = _cli("from-hf", root / "hub", out, env_extra={"EXPERTAX_CONVERT_EXIT_AFTER": "40"})
    assert r.returncode == 75, r.stderr
    with pytest.raises(ValueError, match="not an expertax model directory"):
        model_dir.read_config(out)  # killed: does not look complete
    r = _cli("from-hf", root / "hub", tmp_path / "other")  # another output: not mixed up
    assert r.returncode == 0, r.stderr
    r = _cli("from-hf", root / "deq", out)  # another source into the interrupted dir: refused
    assert r.returncode == 2 and "unfinished conversion of something else" in r.stderr
    r = _cli("from-hf", root / "hub", out)
    assert r.returncode == 0, r.stderr
    assert "40 already done by an earlier run" in r.stdout, r.stdout
    total = int(r.stdout.split("expertax: ")[-1].split()[0]) + 40
    assert total == len([n for n in Reader(root / "hub").names() if "scale" not in n]) - 2
    assert len(SHARED) == 2
    assert _leaves(out) == _leaves(tmp_path / "other")
    assert not (out / ".convert").exists()
    # to-hf: killed after one shard, resumed: the same files as one uninterrupted run
    kw = ("--fp8", "--max-shard-bytes", "1000000")
    r = _cli("to-hf", out, tmp_path / "hf", *kw, env_extra={"EXPERTAX_CONVERT_EXIT_AFTER": "1"})
    assert r.returncode == 75 and not (tmp_path / "hf" / "config.json").exists()
    r = _cli("to-hf", out, tmp_path / "hf", *kw)
    assert r.returncode == 0 and "1 already done" in r.stdout, r.stdout + r.stderr
    r = _cli("to-hf", out, tmp_path / "hf2", *kw)
    assert r.returncode == 0
    for f in (tmp_path / "hf2").iterdir():
        assert (tmp_path / "hf" / f.name).read_bytes() == f.read_bytes(), f.name


def test_progress_line_counts_units_bytes_rate_and_eta():
    out = io.StringIO()
    p = Progress("from-hf", 4, 4 * 2**30, stream=out, force=True)
    p.advance(2**30)
    p.advance(2**30)  # within half a second of the first: not redrawn
    p.advance(2**30)
    p.advance(2**30)  # the last unit: always drawn
    p.close()
    lines = out.getvalue().split("\r")
    assert lines[1].startswith("from-hf: 1/4 tensors  1.00/4.00 GiB  ")
    assert "GiB/s  ETA " in lines[1] and lines[1].endswith(" s\033[K")
    assert lines[-1].startswith("from-hf: 4/4 tensors  4.00/4.00 GiB  ")
    assert "ETA 0 s" in lines[-1] and out.getvalue().endswith("\n")
    # negative control: not a terminal, not forced: silent
    quiet = io.StringIO()
    q = Progress("to-hf", 1, 1, stream=quiet, force=False)
    q.advance(1)
    q.close()
    assert quiet.getvalue() == ""


def test_progress_line_forced_by_the_environment(checkpoints, tmp_path, monkeypatch, capsys):
    root = checkpoints
    monkeypatch.setenv(PROGRESS_ENV, "1")
    s = convert_from_hf(root / "hub", tmp_path / "ours")
    err = capsys.readouterr().err
    assert f"from-hf: {s.tensors}/{s.tensors} tensors" in err, err
    monkeypatch.delenv(PROGRESS_ENV)
    convert_from_hf(root / "hub", tmp_path / "again")
    assert "tensors" not in capsys.readouterr().err  # control: off when not a terminal


def test_fp8_tensors_split_in_row_blocks_convert_the_same(checkpoints, tmp_path, monkeypatch):
    """A split threshold of 40 kB cuts the 264-row dense MLP weights (fp8) into 128-row blocks
    (the last one 8 rows, its scale row a partial block): same bytes as whole tensors, both
    directions."""
    root = checkpoints
    convert_from_hf(root / "hub", tmp_path / "whole")
    convert_to_hf(tmp_path / "whole", tmp_path / "whole-hf", use_fp8=True)
    monkeypatch.setattr(hf_read, "CHUNK_BYTES", 40_000)
    monkeypatch.setattr(hf_write, "CHUNK_BYTES", 40_000)
    with Reader(root / "hub") as reader:
        units = hf_read.plan(reader, hf_read.read_hf_config(root / "hub")).units
    name = "model.layers.0.mlp.gate_proj.weight"
    assert reader_rows(units, name) == [(0, 128), (128, 256), (256, 264)]
    convert_from_hf(root / "hub", tmp_path / "split")
    assert _leaves(tmp_path / "split") == _leaves(tmp_path / "whole")
    convert_to_hf(tmp_path / "split", tmp_path / "split-hf", use_fp8=True)
    whole, split = (
        dict(iter_tensors(tmp_path / "whole-hf")),
        dict(iter_tensors(tmp_path / "split-hf")),
    )
    assert whole.keys() == split.keys()
    assert all(whole[k].tobytes() == split[k].tobytes() for k in whole)
    # negative control: a block's rows written one row off differ
    with Reader(root / "hub") as reader:
        w = reader.get(name, (128, 256))
        assert not np.array_equal(w.view(np.uint8), reader.get(name, (127, 255)).view(np.uint8))


def reader_rows(units, name: str) -> list[tuple[int, int]]:
    return [u.rows for u in units if u.name == name]


@pytest.mark.parametrize("rows", [(0, 5), (3, 10)])
def test_reader_rows_are_the_tensors_rows(checkpoints, rows):
    root = checkpoints
    name = "model.embed_tokens.weight"
    with Reader(root / "hub") as reader:
        whole = reader.get(name)
        assert reader.get(name, rows).tobytes() == whole[rows[0] : rows[1]].tobytes()
