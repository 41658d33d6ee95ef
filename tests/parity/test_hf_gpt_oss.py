"""HuggingFace parity for GPT-OSS: a tiny random GptOssForCausalLM (float32; non-zero sinks,
attention, router and expert biases; 2F != D, head_dim != D / heads; sliding layers shorter than
the prompt) read by `load_hf`: logits within float32's relative tolerance, greedy continuations
equal to transformers' `generate`, each GPT-OSS piece read (negative controls), and the fused
expert layout read by model type where GPT-OSS's [E, D, 2F] has Mixtral's [E, 2F, D] shape."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("torch", reason="parity tests need torch (pip install expertax[parity])")
pytest.importorskip("transformers", reason="parity tests need transformers (extra 'parity')")

from hf_models import build, hf_logits, load_mxfp4, prompt, save, save_mxfp4  # noqa: E402
from tests.tolerances import tol  # noqa: E402

import expertax  # noqa: E402
from expertax.convert import ConversionError, config_from_hf, write_hf  # noqa: E402

pytestmark = pytest.mark.parity
MISS = 1e-3  # a wrong mapping misses by far more than the tolerance (rtol)


def _relative(out, ref) -> float:
    diff = np.max(np.abs(np.asarray(out, np.float64) - np.asarray(ref, np.float64)))
    return float(diff / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    model = build("gpt_oss", seed=3)
    path = save(model, tmp_path_factory.mktemp("gpt_oss"))
    config, params = expertax.load_hf(path)
    return model, path, config, params


def test_logits_and_greedy_match_transformers(gpt_oss):
    import jax

    model, path, config, params = gpt_oss
    assert config.decoder_block == "gpt_oss" and config.attention_layer_pattern == "sliding,full"
    assert config.head_dim == 24 != config.base_emb_dim // config.base_num_query_heads
    assert 2 * config.base_moe_mlp_dim != config.base_emb_dim
    assert not config.rope_yarn_truncate and config.mlp_activation_limit == 1.5
    tokens = prompt().numpy()
    ref = hf_logits(model, prompt())
    forward = jax.jit(lambda p: expertax.logits(p, tokens, config))
    relative = _relative(forward(params), ref)
    print(f"\ngpt_oss: max |logits diff| / max |logit| = {relative:.3g}")
    assert relative <= tol(np.float32)["rtol"]
    # controls: the sinks, a sliding layer's window, the router bias and an expert bias are read
    attn, moe = params.moe_layers.attn, params.moe_layers.moe
    changed = [
        dataclasses.replace(attn, sinks=attn.sinks.at[0].add(-8.0)),
        dataclasses.replace(moe, router=dataclasses.replace(
            moe.router, logit_bias=moe.router.logit_bias.at[0, 0].add(2.0))),
        dataclasses.replace(moe, bo=moe.bo.at[0].add(1.0)),
    ]  # fmt: skip
    for part in changed:
        field = "attn" if part is changed[0] else "moe"
        bad = dataclasses.replace(params, moe_layers=dataclasses.replace(
            params.moe_layers, **{field: part}))  # fmt: skip
        miss = _relative(forward(bad), ref)
        print(f"control: {miss:.3g}")
        assert miss > MISS
    full = config.model_copy(update={"attention_layer_pattern": "", "sliding_window_size": 0})
    assert _relative(expertax.logits(params, tokens, full), ref) > MISS

    short = prompt()[:, :24]
    want = model.generate(short, max_new_tokens=6, do_sample=False)[0, 24:].tolist()
    got = expertax.generate(params, config, [short[0].tolist()], max_new_tokens=6,
                            devices=jax.devices()[:1])  # fmt: skip
    assert got.tokens[0] == want


def test_fused_experts_read_by_model_type_where_shapes_coincide(tmp_path):
    """2F = D: GPT-OSS's interleaved [E, D, 2F] is Mixtral's [E, 2F, D] in shape; read as
    GPT-OSS's (by model type), the logits match; the same tensors read as the other layout
    would not (control: de-interleaving them differently misses)."""
    model = build("gpt_oss-2f-is-d", seed=4)
    path = save(model, tmp_path)
    config, params = expertax.load_hf(path)
    assert 2 * config.base_moe_mlp_dim == config.base_emb_dim
    ref = hf_logits(model, prompt())
    tokens = prompt().numpy()
    assert _relative(expertax.logits(params, tokens, config), ref) <= tol(np.float32)["rtol"]
    moe = params.moe_layers.moe
    gate_up = np.concatenate([moe.wi_0, moe.wi_1], axis=-1)  # as if [.., :F] and [.., F:]
    f = config.base_moe_mlp_dim
    misread = dataclasses.replace(moe, wi_0=gate_up[..., ::2], wi_1=gate_up[..., 1::2])
    assert f == misread.wi_0.shape[-1]
    bad = dataclasses.replace(params, moe_layers=dataclasses.replace(params.moe_layers,
                                                                      moe=misread))  # fmt: skip
    assert _relative(expertax.logits(bad, tokens, config), ref) > MISS
    hf = json.loads((path / "config.json").read_text())
    assert hf["model_type"] == "gpt_oss"


def test_mxfp4_checkpoint_matches_transformers_reading_it(tmp_path, monkeypatch):
    """The hub's format: experts in MXFP4 (blocks + scales), read by expertax in units of two
    experts (CHUNK_BYTES lowered) and by transformers (dequantized): the same logits; the same
    bytes read with the nibbles swapped (a wrong packing) miss. (Greedy decoding is the bf16
    test's: the format changes only how expert weights are read.)"""
    import jax
    from safetensors.numpy import load_file, save_file

    from expertax.convert import hf_read, safetensors_io

    path = save_mxfp4(build("gpt_oss-mxfp4", seed=5), tmp_path / "hub")
    model = load_mxfp4(path)
    ref = hf_logits(model, prompt())
    per_expert = 64 * 128 * 4  # [D, 2F] float32: two experts per unit, three units a tensor
    monkeypatch.setattr(hf_read, "CHUNK_BYTES", 2 * per_expert)
    with safetensors_io.Reader(path) as reader:
        units = hf_read.plan(reader, hf_read.read_hf_config(path)).units
    assert [u.rows for u in units if u.name.endswith("0.mlp.experts.gate_up_proj_blocks")] == [
        (0, 2), (2, 4), (4, 6)]  # fmt: skip
    config, params = expertax.load_hf(path)
    tokens = prompt().numpy()
    forward = jax.jit(lambda p: expertax.logits(p, tokens, config))
    relative = _relative(forward(params), ref)
    print(f"\ngpt_oss mxfp4: max |logits diff| / max |logit| = {relative:.3g}")
    assert relative <= tol(np.float32)["rtol"]
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_blocks")]:
        tensors[name] = (tensors[name] << 4) | (tensors[name] >> 4)
    save_file(tensors, path / "model.safetensors")
    _, swapped = expertax.load_hf(path)
    assert _relative(forward(swapped), ref) > MISS


def test_mxfp4_refusals_name_the_tensor_or_field(gpt_oss, tmp_path):
    _, path, _, _ = gpt_oss
    hf = json.loads((path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "block_size": 64}
    with pytest.raises(ConversionError, match="quantization_config.block_size=64"):
        config_from_hf(hf)
    hub = save_mxfp4(build("gpt_oss-mxfp4", seed=5), tmp_path / "hub")
    cfg = json.loads((hub / "config.json").read_text())
    del cfg["quantization_config"]
    (hub / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"experts.\w+_proj_blocks is MXFP4 but config"):
        expertax.load_hf(hub)


def test_to_hf_is_read_by_transformers_with_the_same_logits(gpt_oss, tmp_path):
    """expertax's parameters written as GPT-OSS (config.json and weights) and loaded by
    transformers give the original model's logits exactly (the same weights, every field of
    the config that matters: layer_types, sliding_window, sinks, biases, YaRN, swiglu_limit)."""
    from transformers import GptOssForCausalLM

    model, _, config, params = gpt_oss
    write_hf(params, config, tmp_path / "out")
    again = GptOssForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert np.array_equal(hf_logits(again.eval(), prompt()), hf_logits(model, prompt()))


def test_hub_to_expertax_to_hub_is_bit_for_bit(tmp_path, monkeypatch):
    """A bfloat16 hub checkpoint through the streaming converters (from-hf, then to-hf, fused
    experts in units and jobs of two experts): the same tensors bit for bit and the same
    config fields."""
    import torch

    from expertax.convert import convert_from_hf, convert_to_hf, hf_read, hf_write
    from expertax.convert.safetensors_io import iter_tensors

    hub = save(build("gpt_oss", seed=6).to(torch.bfloat16), tmp_path / "hub")
    per_expert = 64 * 80 * 2  # gate_up_proj [D, 2F] bfloat16
    monkeypatch.setattr(hf_read, "CHUNK_BYTES", 2 * per_expert)
    monkeypatch.setattr(hf_write, "CHUNK_BYTES", 2 * per_expert)
    with hf_read.Reader(hub) as reader:
        units = hf_read.plan(reader, hf_read.read_hf_config(hub)).units
    assert [u.rows for u in units if u.name.endswith("1.mlp.experts.gate_up_proj")] == [
        (0, 2), (2, 4), (4, 6)]  # fmt: skip
    convert_from_hf(hub, tmp_path / "ours")
    summary = convert_to_hf(tmp_path / "ours", tmp_path / "back")
    assert summary.tensors > len(dict(iter_tensors(hub)))  # fused tensors in several jobs
    want, got = dict(iter_tensors(hub)), dict(iter_tensors(tmp_path / "back"))
    assert sorted(want) == sorted(got)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and np.array_equal(
            got[name].view(np.uint16), w.view(np.uint16)), name  # fmt: skip
    hf = json.loads((hub / "config.json").read_text())
    out = json.loads((tmp_path / "back" / "config.json").read_text())
    rope = hf.get("rope_parameters") or hf["rope_scaling"]
    for key, value in rope.items():
        assert out["rope_scaling"].get("type" if key == "rope_type" else key, value) == value, key
    differ = {k: (v, out.get(k)) for k, v in hf.items() if k in out and out[k] != v}
    print(f"\nfields written otherwise: {differ}; not written: {sorted(set(hf) - set(out))}")
    assert not differ and config_from_hf(out) == config_from_hf(hf)
