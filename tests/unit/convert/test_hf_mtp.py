"""HF conversion of DeepSeek-V3's multi-token-prediction layer, both ways, without torch: the
hub's names and layouts, the round trip bit for bit (bfloat16; fp8 in test_fp8_and_resume.py),
the shared embedding and head copies checked on reading, the refusals, and the converted
model's MTP loss against the oracle of tests/unit/models/test_mtp.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import expertax
from expertax.convert import (
    ConversionError,
    config_from_hf,
    convert_from_hf,
    convert_to_hf,
    hf_read,
    load_hf,
    params_from_hf,
    write_hf,
)
from expertax.convert.safetensors_io import Reader, iter_tensors
from expertax.preflight import build_config
from expertax.train import model_dir
from expertax.train import step as step_lib
from tests.tolerances import tol
from tests.unit.convert.hub import (
    BF16,
    FP8,
    MTP_LAYER,
    SMALL,
    random_params,
    ref_dequantize,
    ref_quantize,
    save_hub,
)
from tests.unit.models.test_mtp import B, T, oracle_loss

P = f"model.layers.{MTP_LAYER}."
# The hub's names of DeepSeek-V3's MTP layer (model.layers.61 of the published checkpoint),
# written out here rather than taken from the converter's table.
HUB_MTP_NAMES = {
    P + n
    for n in [
        "embed_tokens.weight",
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_a_proj.weight",
        "self_attn.q_a_layernorm.weight",
        "self_attn.q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_a_layernorm.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
        *(f"mlp.shared_experts.{w}_proj.weight" for w in ("gate", "up", "down")),
        *(f"mlp.experts.{j}.{w}_proj.weight" for j in range(8) for w in ("gate", "up", "down")),
    ]
}


def _tensors(path) -> dict[str, np.ndarray]:
    return dict(iter_tensors(path))


def _hub_copy(src, dst, change=lambda t: t, config_change=lambda h: h):
    """The checkpoint at `src` with its tensors and config.json changed, saved at `dst`."""
    hf = json.loads((src / "config.json").read_text())
    return save_hub(dst, change(_tensors(src)), config_change(hf))


def test_hub_layout_of_the_mtp_layer(checkpoints):
    """The tiny checkpoint's layer 3 has exactly the hub's MTP names, eh_proj is [D, 2D], and
    the fp8 one quantizes the block's projections but not eh_proj or the shared head."""
    hub = _tensors(checkpoints / "hub")
    deq = _tensors(checkpoints / "deq")
    assert {n for n in deq if n.startswith(P)} == HUB_MTP_NAMES
    assert deq[P + "eh_proj.weight"].shape == (200, 400)
    assert hub[P + "eh_proj.weight"].dtype == BF16 and P + "eh_proj.weight_scale_inv" not in hub
    assert hub[P + "shared_head.head.weight"].dtype == BF16
    assert hub[P + "mlp.experts.0.up_proj.weight"].dtype == FP8
    hf = json.loads((checkpoints / "deq" / "config.json").read_text())
    assert hf["num_nextn_predict_layers"] == 1 and hf["num_hidden_layers"] == MTP_LAYER


def test_bfloat16_round_trip_is_exact(checkpoints, tmp_path):
    src = checkpoints / "deq"
    summary = convert_from_hf(src, tmp_path / "ours")
    assert summary.config.mtp_num_layers == 1 and summary.notes == []
    # the shared copies are checked, not converted
    assert summary.tensors == len(_tensors(src)) - 2
    files = convert_to_hf(tmp_path / "ours", tmp_path / "back", max_shard_bytes=2**20).files
    assert len(files) > 2  # sharded
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["num_nextn_predict_layers"] == 1
    source, written = _tensors(src), _tensors(tmp_path / "back")
    assert written.keys() == source.keys()
    for name, w in source.items():
        assert written[name].dtype == w.dtype and written[name].tobytes() == w.tobytes(), name


def _rope_columns(w_DX: np.ndarray, offset: int, r: int) -> np.ndarray:
    """HF interleaved RoPE columns [offset, offset + r) as evens then odds (our layout)."""
    cols = list(range(offset)) + [offset + k for k in [*range(0, r, 2), *range(1, r, 2)]]
    return w_DX[:, cols]


def test_mtp_leaves_are_the_hub_tensors(checkpoints):
    """After from-hf, `params.mtp` holds the hub's MTP tensors: norms copied, nn.Linear weights
    transposed ([2D, D] eh_proj: embedding rows first), RoPE columns permuted."""
    c, params, _ = params_from_hf(checkpoints / "deq")
    hub = _tensors(checkpoints / "deq")
    m = params.mtp
    for ours, name in [
        (m.enorm, "enorm"),
        (m.hnorm, "hnorm"),
        (m.head_norm, "shared_head.norm"),
        (m.block.attn_norm, "input_layernorm"),
        (m.block.ffn_norm, "post_attention_layernorm"),
        (m.block.attn.kv_norm, "self_attn.kv_a_layernorm"),
    ]:
        np.testing.assert_array_equal(ours[0], hub[P + name + ".weight"], err_msg=name)
    eh = hub[P + "eh_proj.weight"]
    np.testing.assert_array_equal(m.eh_proj[0], eh.T)
    # negative control: the hidden-state half first (the technical report's order) differs
    assert not np.array_equal(m.eh_proj[0], np.concatenate([eh.T[200:], eh.T[:200]]))
    moe = m.block.moe
    np.testing.assert_array_equal(moe.router.w[0], hub[P + "mlp.gate.weight"].T)
    np.testing.assert_array_equal(moe.router.bias[0], hub[P + "mlp.gate.e_score_correction_bias"])
    for j in (0, 7):
        e = f"{P}mlp.experts.{j}."
        np.testing.assert_array_equal(moe.wi_0[0, j], hub[e + "gate_proj.weight"].T)
        np.testing.assert_array_equal(moe.wi_1[0, j], hub[e + "up_proj.weight"].T)
        np.testing.assert_array_equal(moe.wo[0, j], hub[e + "down_proj.weight"].T)
    np.testing.assert_array_equal(
        moe.shared.wo[0], hub[P + "mlp.shared_experts.down_proj.weight"].T
    )
    wkv_a = hub[P + "self_attn.kv_a_proj_with_mqa.weight"].T
    np.testing.assert_array_equal(
        m.block.attn.wkv_a[0], _rope_columns(wkv_a, c.kv_lora_rank, c.qk_rope_head_dim)
    )
    assert not np.array_equal(m.block.attn.wkv_a[0], wkv_a)  # control: the permutation shows
    # the shared copies are the main model's embedding and head
    np.testing.assert_array_equal(params.embed, hub[P + "embed_tokens.weight"])
    np.testing.assert_array_equal(params.lm_head, hub[P + "shared_head.head.weight"].T)


def test_converted_mtp_loss_equals_the_oracle(checkpoints):
    """loss_fn on the converted parameters (float32) gives finite per-depth MTP losses, and the
    total equals the plainly written oracle on the same weights."""
    c, params = load_hf(checkpoints / "hub")
    assert c.mtp_num_layers == 1
    keys = {**c.model_dump(), "dtype": "float32", "weight_dtype": "float32"}
    c = build_config({**keys, "max_target_length": T, "mtp_loss_scaling_factor": 0.3})
    params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    rng = np.random.default_rng(1)
    batch = {
        "inputs": jnp.asarray(rng.integers(0, c.vocab_size, (B, T)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, c.vocab_size, (B, T)), jnp.int32),
        "weights": jnp.ones((B, T), jnp.float32),
    }
    total, parts = jax.jit(lambda p: step_lib.loss_fn(p, batch, c))(params)
    assert parts.mtp_losses.shape == (1,) and np.isfinite(np.asarray(parts.mtp_losses)).all()
    assert float(total) > float(parts.ce)  # the MTP term counts
    want, _ = jax.jit(lambda p: oracle_loss(p, batch, c))(params)
    np.testing.assert_allclose(float(total), float(want), **tol())


def _one_ulp(t: dict, name: str, where: tuple) -> dict:
    w = t[name].copy()
    bits = w.view(np.uint16)
    bits[where] ^= 1
    return {**t, name: w}


@pytest.mark.parametrize(
    "kind,name,main,where",
    [
        ("deq", "embed_tokens.weight", "model.embed_tokens.weight", (250, 7)),
        ("hub", "shared_head.head.weight", "lm_head.weight", (3, 199)),
    ],
)
def test_a_shared_copy_that_differs_is_refused(checkpoints, tmp_path, kind, name, main, where):
    """One bit of the MTP layer's embedding or head copy flipped: refused before anything is
    written, naming the tensor, the main one, where they differ and why."""
    bad = _hub_copy(checkpoints / kind, tmp_path / "bad", lambda t: _one_ulp(t, P + name, where))
    msg = rf"tensor {P + name} differs from {main}: 1 of 60000 values, the first at \[{where[0]}, "
    with pytest.raises(ConversionError, match=msg) as err:
        convert_from_hf(bad, tmp_path / "out")
    assert "expertax shares the embedding and the output head" in str(err.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConversionError, match=msg):
        load_hf(bad)
    convert_from_hf(checkpoints / kind, tmp_path / "ok")  # control: the checkpoint unchanged


def test_a_shared_copy_differing_in_a_row_block_is_refused(checkpoints, tmp_path, monkeypatch):
    """Copies larger than a chunk are compared block by block; the position is the tensor's."""
    monkeypatch.setattr(hf_read, "CHUNK_BYTES", 40_000)  # the [300, 200] embedding: 3 blocks
    src = checkpoints / "deq"
    with Reader(src) as reader:
        p = hf_read.plan(reader, hf_read.read_hf_config(src))
    assert [u.rows for u, _ in p.checks if "embed" in u.name] == [(0, 128), (128, 256), (256, 300)]
    bad = _hub_copy(
        src, tmp_path / "bad", lambda t: _one_ulp(t, P + "embed_tokens.weight", (257, 3))
    )
    with pytest.raises(ConversionError, match=r"rows 256..299, the first at \[257, 3\]"):
        convert_from_hf(bad, tmp_path / "out")


def test_shared_copies_of_another_dtype_are_refused_and_absent_ones_accepted(checkpoints, tmp_path):
    src = checkpoints / "deq"
    name = P + "embed_tokens.weight"

    def as_float32(t):
        return {**t, name: t[name].astype(np.float32)}

    bad = _hub_copy(src, tmp_path / "f32", as_float32)
    with pytest.raises(ConversionError, match=f"{name} has dtype float32, model.embed_tokens"):
        convert_from_hf(bad, tmp_path / "out")
    # without the copies (expertax holds the tensors once): converted; to-hf writes them back
    shared = {name, P + "shared_head.head.weight"}
    lean = _hub_copy(
        src, tmp_path / "lean", lambda t: {k: v for k, v in t.items() if k not in shared}
    )
    convert_from_hf(lean, tmp_path / "ours")
    convert_to_hf(tmp_path / "ours", tmp_path / "back")
    back, source = _tensors(tmp_path / "back"), _tensors(src)
    assert back.keys() == source.keys()
    assert all(back[k].tobytes() == source[k].tobytes() for k in shared)


def test_mtp_layers_absent_or_beyond_the_config(checkpoints, tmp_path):
    src = checkpoints / "deq"
    # transformers' save_pretrained keeps num_nextn_predict_layers but drops the layer
    main = _hub_copy(src, tmp_path / "main", lambda t: {k: v for k, v in t.items() if P not in k})
    summary = convert_from_hf(main, tmp_path / "ours")
    assert summary.config.mtp_num_layers == 0
    assert "holds no tensor of its layer 3: converted without multi-token" in summary.notes[0]
    convert_to_hf(tmp_path / "ours", tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["num_nextn_predict_layers"] == 0
    # the layer's tensors with num_nextn_predict_layers=0: refused, naming the layer counts
    beyond = _hub_copy(
        src, tmp_path / "beyond", config_change=lambda h: {**h, "num_nextn_predict_layers": 0}
    )
    with pytest.raises(ConversionError, match=r"belongs to layer 3; .*num_nextn_predict_layers=0"):
        convert_from_hf(beyond, tmp_path / "out")
    # a partial layer: the missing tensor is named
    part = _hub_copy(
        src, tmp_path / "part", lambda t: {k: v for k, v in t.items() if "eh_proj" not in k}
    )
    with pytest.raises(ConversionError, match=f"lacks tensors {P}eh_proj.weight"):
        convert_from_hf(part, tmp_path / "out")


def test_mtp_config_fields():
    from expertax.convert.hf_config import _HF_DEFAULTS

    ds = {**_HF_DEFAULTS["deepseek_v3"], "model_type": "deepseek_v3"}
    assert config_from_hf({**ds, "num_nextn_predict_layers": 2}).mtp_num_layers == 2
    assert config_from_hf(ds).mtp_num_layers == 0  # absent: no MTP layer
    mx = {**_HF_DEFAULTS["mixtral"], "model_type": "mixtral"}
    assert config_from_hf({**mx, "num_nextn_predict_layers": 0}).mtp_num_layers == 0
    with pytest.raises(ConversionError, match="num_nextn_predict_layers=1: multi-token-pred"):
        config_from_hf({**mx, "num_nextn_predict_layers": 1})
    with pytest.raises(ConversionError, match="num_mtp_layers=1"):
        config_from_hf({**ds, "num_mtp_layers": 1})
    with pytest.raises(ConversionError, match="first_k_dense_replace=61 >= num_hidden_layers"):
        config_from_hf({**ds, "num_nextn_predict_layers": 1, "first_k_dense_replace": 61})


@pytest.mark.parametrize("model", ["mixtral-tiny", "llama-tiny"])
def test_to_hf_refuses_mtp_outside_deepseek(model, tmp_path):
    """A Mixtral or Llama model trained with MTP has no HF place for its MTP modules: refused
    before anything is written; the same model without MTP converts (control)."""
    over = {"model_name": model, "vocab_size": 64, "base_emb_dim": 32, "weight_dtype": "bfloat16"}
    c = expertax.load_config(overrides={**over, "mtp_num_layers": 1})
    model_dir.save(tmp_path / "ours", c, random_params(c, 0), source="test")
    msg = f"mtp_num_layers=1 with decoder_block='{c.decoder_block}': HF's formats have multi"
    with pytest.raises(ConversionError, match=msg):
        convert_to_hf(tmp_path / "ours", tmp_path / "back")
    assert not (tmp_path / "back").exists()
    with pytest.raises(ConversionError, match=msg):
        write_hf(random_params(c, 0), c, tmp_path / "back2")
    assert not (tmp_path / "back2").exists()
    if model == "mixtral-tiny":
        plain = expertax.load_config(overrides=over)
        write_hf(random_params(plain, 0), plain, tmp_path / "plain")
        assert (tmp_path / "plain" / "config.json").is_file()


def test_fp8_shared_copy_is_compared_after_dequantization(checkpoints, tmp_path):
    """A copy stored in fp8 (with its scales) equals a bfloat16 main tensor when it dequantizes
    to the same bytes: accepted; compared as converted, not as stored."""
    src = checkpoints / "hub"
    name = P + "shared_head.head.weight"
    t = _tensors(src)
    lm = t["lm_head.weight"]
    # an fp8 copy whose dequantization we then make the main tensor: both read equal
    q, grid = ref_quantize(lm)
    t.update({name: q, name + "_scale_inv": grid, "lm_head.weight": ref_dequantize(q, grid)})
    hf = json.loads((src / "config.json").read_text())
    ok = save_hub(tmp_path / "ok", t, hf)
    c, params, _ = params_from_hf(ok)
    np.testing.assert_array_equal(params.lm_head, ref_dequantize(q, grid).T)
    t["lm_head.weight"] = lm  # control: the stored bfloat16 head differs from the dequantized
    bad = save_hub(tmp_path / "bad", t, hf)
    with pytest.raises(ConversionError, match=f"{name} differs from lm_head.weight"):
        params_from_hf(bad)


def test_tied_embeddings_round_trip(tmp_path):
    """With tied embeddings the head copy (shared_head.head) is the embedding's: written from it,
    checked against model.embed_tokens.weight."""
    c = expertax.load_config(overrides={**SMALL, "logits_via_embedding": True})
    write_hf(random_params(c, 1), c, tmp_path / "hf")
    source = _tensors(tmp_path / "hf")
    assert "lm_head.weight" not in source
    head = source[P + "shared_head.head.weight"]
    assert head.tobytes() == source["model.embed_tokens.weight"].tobytes()
    convert_from_hf(tmp_path / "hf", tmp_path / "ours")
    convert_to_hf(tmp_path / "ours", tmp_path / "back")
    back = _tensors(tmp_path / "back")
    assert back.keys() == source.keys()
    assert all(back[k].tobytes() == source[k].tobytes() for k in source)
    bad = _hub_copy(
        tmp_path / "hf",
        tmp_path / "bad",
        lambda t: _one_ulp(t, P + "shared_head.head.weight", (0, 0)),
    )
    with pytest.raises(ConversionError, match="shared_head.head.weight differs from model.embed"):
        convert_from_hf(bad, tmp_path / "out")


# GLM-4.5-Air's MTP layer (its 47th, index 46) as the published checkpoint names it: modules from
# a public list of the hub checkpoint's unquantized tensors, plus the head copy vLLM's GLM-4.5 MTP
# loader reads (`shared_head.head`). transformers has no GLM MTP module to check against.
GLM_AIR_MTP_PUBLISHED = {
    "model.layers.46." + n
    for n in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "embed_tokens.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
    )
}


def test_glm_mtp_layer_names_match_the_published_checkpoint():
    """glm4.5-air with its MTP layer maps every published layer-46 name, and its other layer-46
    names are the main stack's MoE layer names (layer 45) or the MTP extras."""
    from expertax.convert.hf import tensor_map

    c = expertax.load_config(overrides={"model_name": "glm4.5-air", "mtp_num_layers": 1})
    names = {t.hf_name for t in tensor_map(c)}
    assert GLM_AIR_MTP_PUBLISHED <= names, GLM_AIR_MTP_PUBLISHED - names
    main = {n.removeprefix("model.layers.45.") for n in names if n.startswith("model.layers.45.")}
    extras = {n.removeprefix("model.layers.46.") for n in GLM_AIR_MTP_PUBLISHED} - main
    ours = {n.removeprefix("model.layers.46.") for n in names if n.startswith("model.layers.46.")}
    assert ours == main | extras
    assert "model.layers.47.enorm.weight" not in names
