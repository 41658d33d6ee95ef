"""from-hf copies the HF folder's tokenizer files into the model directory (for `expertax
generate`), and to-hf copies them back beside the weights."""

from __future__ import annotations

import jax
import numpy as np

from expertax.convert import convert_from_hf, convert_to_hf, write_hf
from expertax.convert.safetensors_io import iter_tensors
from expertax.models import decoder
from expertax.nn.param import is_spec
from expertax.preflight import load_config
from expertax.train import model_dir

TINY = dict(
    model_name="mixtral-tiny",
    base_emb_dim=32,
    head_dim=16,
    base_moe_mlp_dim=32,
    vocab_size=64,
    base_num_decoder_layers=1,
    num_experts=4,
)


def test_from_hf_copies_the_tokenizer_files_it_finds(tmp_path):
    c = load_config(overrides=TINY)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: rng.standard_normal(s.shape).astype(np.float32), decoder.spec(c), is_leaf=is_spec
    )
    hf = tmp_path / "hf"
    write_hf(params, c, hf)
    files = {"tokenizer.json": '{"version": "1.0"}\n', "tokenizer_config.json": "{}\n"}
    for name, text in files.items():
        (hf / name).write_text(text)
    convert_from_hf(hf, tmp_path / "model")
    for name in model_dir.TOKENIZER_FILES:
        copied = tmp_path / "model" / name
        assert copied.read_text() == files[name] if name in files else not copied.exists()
    # to-hf of the directory: every tensor back, bit for bit, and the tokenizer files
    summary = convert_to_hf(tmp_path / "model", tmp_path / "back")
    for name in model_dir.TOKENIZER_FILES:
        copied = tmp_path / "back" / name
        assert copied.read_text() == files[name] if name in files else not copied.exists()
        assert (name in summary.files) == (name in files)
    back = dict(iter_tensors(tmp_path / "back"))
    source = dict(iter_tensors(hf))
    assert back.keys() == source.keys()
    assert all(back[k].tobytes() == v.tobytes() for k, v in source.items())
