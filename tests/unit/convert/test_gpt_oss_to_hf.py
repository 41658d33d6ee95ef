"""GPT-OSS to HF and back without torch: an expertax model (random bfloat16 parameters of
gpt-oss-tiny) written as the hub's layout and read back is the same model, bit for bit, and
its config round-trips; fp8 writing is refused. (transformers reading the written checkpoint:
tests/parity/test_hf_gpt_oss.py.)"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import expertax
from expertax.convert import ConversionError, config_from_hf, write_hf
from expertax.convert.safetensors_io import iter_tensors
from tests.unit.convert.hub import random_params

KEYS = {"model_name": "gpt-oss-tiny", "weight_dtype": "bfloat16", "dtype": "bfloat16"}


def test_expertax_to_hub_to_expertax_is_exact(tmp_path):
    c = expertax.load_config(overrides=KEYS)
    params = random_params(c, 1)
    write_hf(params, c, tmp_path / "hub")
    hf = json.loads((tmp_path / "hub" / "config.json").read_text())
    tensors = dict(iter_tensors(tmp_path / "hub"))
    assert tensors["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 96, 80)
    gate = np.asarray(params.moe_layers.moe.wi_0[1])
    assert np.array_equal(tensors["model.layers.1.mlp.experts.gate_up_proj"][..., ::2], gate)
    assert "model.layers.0.self_attn.sinks" in tensors
    assert hf["model_type"] == "gpt_oss" and hf["swiglu_limit"] == 7.0
    back, params_back = expertax.load_hf(tmp_path / "hub")
    keys = ("attention_layer_pattern", "sliding_window_size", "rope_yarn_truncate", "rope_factor",
            "mlp_activation_limit", "head_dim", "num_experts", "base_moe_mlp_dim",
            "router_logit_bias", "moe_expert_bias", "attention_sinks")  # fmt: skip
    for key in keys:
        assert getattr(back, key) == getattr(c, key), key
    same = jax.tree.map(
        lambda a, b: np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)),
        params,
        params_back,
    )
    assert all(jax.tree.leaves(same))
    assert config_from_hf(hf).attention_layer_pattern == "sliding,full"
    with pytest.raises(ConversionError, match="to-hf --fp8"):
        write_hf(params, c, tmp_path / "fp8", use_fp8=True)
