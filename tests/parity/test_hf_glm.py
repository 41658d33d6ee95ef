"""HuggingFace parity of the DeepSeek-style MoE families beside DeepSeek-V3: GLM-4.5
(`glm4_moe`: GQA with q/k/v biases, optional q/k norm, partial RoPE; with a multi-token-
prediction layer in the checkpoint), DeepSeek-V2 (`deepseek_v2`: MLA without q LoRA, softmax
routing, greedy and group-limited greedy) and Kimi-K2 (`kimi_k2`, DeepSeek-V3's architecture:
checked through transformers' DeepSeek-V3 with the model_type rewritten). Tiny random float32
models built by transformers (hf_models.py); greedy decoding against transformers' generate is
in tests/unit/decoding/test_hf_generate.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="parity tests need torch (pip install expertax[parity])")
pytest.importorskip("transformers", reason="parity tests need transformers (extra 'parity')")

import torch  # noqa: E402
from hf_models import build, hf_logits, prompt, save  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from tests.tolerances import tol  # noqa: E402

import expertax  # noqa: E402
from expertax.convert import ConversionError, config_from_hf, config_to_hf, from_hf, to_hf  # noqa: E402
from expertax.convert.safetensors_io import iter_tensors  # noqa: E402

pytestmark = pytest.mark.parity

KINDS = ["glm", "glm-plain", "deepseek-v2", "deepseek-v2-groups"]
MISS = 1e-2  # a wrong mapping misses by far more than float32's tolerance (negative controls)
MTP = 3  # the tiny models have 3 layers: a multi-token-prediction layer is model.layers.3


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return dict(iter_tensors(path))


def add_mtp_layer(path: Path, rng: np.random.Generator) -> set[str]:
    """GLM-4.5's multi-token-prediction layer as the hub stores it (model.layers.<L>. of
    zai-org/GLM-4.5: enorm, hnorm, eh_proj, a decoder block, shared_head.norm, and copies of the
    embedding and output head), written into the checkpoint at `path`: the block's tensors are
    layer 1's renamed (an MoE layer: the same shapes), with new values. Returns its names."""
    t = _tensors(path)
    d = t["model.norm.weight"].shape[0]
    p = f"model.layers.{MTP}."
    new = {
        p + k[len("model.layers.1.") :]: rng.standard_normal(v.shape).astype(v.dtype)
        for k, v in t.items()
        if k.startswith("model.layers.1.")
    }
    new[p + "enorm.weight"] = 1 + 0.2 * rng.standard_normal(d).astype(np.float32)
    new[p + "hnorm.weight"] = 1 + 0.2 * rng.standard_normal(d).astype(np.float32)
    new[p + "shared_head.norm.weight"] = 1 + 0.2 * rng.standard_normal(d).astype(np.float32)
    new[p + "eh_proj.weight"] = rng.standard_normal((d, 2 * d)).astype(np.float32) / d
    new[p + "embed_tokens.weight"] = t["model.embed_tokens.weight"]
    new[p + "shared_head.head.weight"] = t["lm_head.weight"]
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file({**t, **new}, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return set(new)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, tuple[Path, np.ndarray]]:
    """Each kind saved once with its reference logits; "glm" with an MTP layer added."""
    out = {}
    for i, kind in enumerate(KINDS):
        model = build(kind, seed=20 + i)
        path = save(model, tmp_path_factory.mktemp(kind))
        if kind == "glm":
            add_mtp_layer(path, np.random.default_rng(i))
        out[kind] = (path, hf_logits(model, prompt()))
    return out


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _replace(params, stack: str, part: str, **change):
    layers = getattr(params, stack)
    new = dataclasses.replace(getattr(layers, part), **change)
    return dataclasses.replace(params, **{stack: dataclasses.replace(layers, **{part: new})})


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(hf_dirs, kind):
    """Within float32's relative tolerance of transformers' logits; the config read as
    published (dims that line up nowhere); negative controls where a mapping could be lost."""
    import jax

    path, ref = hf_dirs[kind]
    config, params = expertax.load_hf(path)
    tokens = prompt().numpy()
    forward = jax.jit(lambda p, c=config: expertax.logits(p, tokens, c))
    rel = _relative(forward(params), ref)
    print(f"\n{kind}: max |logits diff| / max |logit| = {rel:.3g}")
    assert rel <= tol(np.float32)["rtol"]
    assert config.decoder_block == "deepseek" and config.num_dense_layers == 1
    if kind.startswith("glm"):
        assert config.attention_type == "gqa" and config.attention_qkv_bias
        assert config.attention_qk_norm == (kind == "glm") and config.partial_rotary_factor == 0.5
        assert config.head_dim == 24 != config.base_emb_dim // config.base_num_query_heads
        assert config.routed_bias and config.uses_routing_groups and config.shared_experts == 1
        assert config.mtp_num_layers == (kind == "glm") == (params.mtp is not None)
        # each q/k/v bias is read where transformers reads it: one element moved misses
        for name in ("bq", "bk", "bv"):
            b = getattr(params.moe_layers.attn, name)
            changed = _replace(params, "moe_layers", "attn", **{name: b.at[0, 0, 0].add(1.0)})
            assert _relative(forward(changed), ref) > MISS, name
        if kind != "glm":
            return  # the RoPE control once
        # RoPE over the whole head instead of its first half misses
        whole = config.model_copy(update={"partial_rotary_factor": 1.0})
        assert _relative(expertax.logits(params, tokens, whole), ref) > MISS
    else:
        assert config.attention_type == "mla" and config.q_lora_rank == 0
        assert config.routed_score_func == "softmax" and not config.routed_bias
        assert config.shared_experts == 2 and not config.norm_topk_prob
        assert config.uses_routing_groups == (kind == "deepseek-v2-groups")
        if kind == "deepseek-v2-groups":  # groups scored by their best expert, not the top-2 sum
            assert config.routing_group_score == "max"
            top2 = config.model_copy(update={"routing_group_score": "top2_sum"})
            assert _relative(expertax.logits(params, tokens, top2), ref) > MISS


def test_converted_glm_mtp_loss_equals_the_oracle(hf_dirs):
    """The MTP layer read from GLM-4.5's hub layout trains: loss_fn's total (main and MTP
    cross-entropy) equals the plainly written oracle of tests/unit/models/test_mtp.py."""
    import jax
    import jax.numpy as jnp
    from tests.unit.models.test_mtp import B, T, oracle_loss

    from expertax.preflight import build_config
    from expertax.train import step as step_lib

    c, params = expertax.load_hf(hf_dirs["glm"][0])
    c = build_config({**c.model_dump(), "max_target_length": T, "mtp_loss_scaling_factor": 0.3})
    rng = np.random.default_rng(1)
    batch = {
        "inputs": jnp.asarray(rng.integers(0, c.vocab_size, (B, T)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, c.vocab_size, (B, T)), jnp.int32),
        "weights": jnp.ones((B, T), jnp.float32),
    }
    total, parts = jax.jit(lambda p: step_lib.loss_fn(p, batch, c))(params)
    assert parts.mtp_losses.shape == (1,) and float(total) > float(parts.ce)
    want, _ = jax.jit(lambda p: oracle_loss(p, batch, c))(params)
    np.testing.assert_allclose(float(total), float(want), **tol())


@pytest.mark.parametrize("kind", ["glm", "deepseek-v2-groups"])
def test_round_trip_is_bitwise(hf_dirs, tmp_path, kind):
    """from-hf then to-hf: every tensor bit for bit (GLM: its MTP layer, embedding and head
    copies included), the model fields of config.json kept; transformers reads the written
    checkpoint into the same logits."""
    from transformers import AutoModelForCausalLM

    src, ref = hf_dirs[kind]
    from_hf(src, tmp_path / "ours")
    to_hf(tmp_path / "ours", tmp_path / "back")
    a, b = _tensors(src), _tensors(tmp_path / "back")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
    if kind == "glm":
        assert f"model.layers.{MTP}.shared_head.head.weight" in b
        assert "model.layers.1.self_attn.q_proj.bias" in b
    hf, back = (json.loads((p / "config.json").read_text()) for p in (src, tmp_path / "back"))
    other = {"rope_parameters", "transformers_version", "use_cache", "output_router_logits"}
    other |= {"dtype", "architectures", "num_mtp_layers", "n_group", "topk_group"}
    for key, value in hf.items():
        if key in back and key not in other:
            assert back[key] == value, key
    assert back["model_type"] == hf["model_type"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    assert _relative(hf_logits(model.eval(), prompt()), ref) == 0.0


def test_kimi_k2_is_deepseek_v3(tmp_path):
    """kimi_k2: DeepSeek-V3's architecture under its own model_type (the hub's auto_map to its
    remote code): read as DeepSeek-V3 (transformers' DeepseekV3 the oracle), written back as
    kimi_k2 with the same tensors."""
    model = build("deepseek-plain-q", seed=31)
    src = save(model, tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    auto_map = {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}
    cfg.update(model_type="kimi_k2", auto_map=auto_map)
    (src / "config.json").write_text(json.dumps(cfg))
    config, params = expertax.load_hf(src)
    rel = _relative(expertax.logits(params, prompt().numpy(), config), hf_logits(model, prompt()))
    print(f"\nkimi_k2 (as deepseek_v3): max |logits diff| / max |logit| = {rel:.3g}")
    assert rel <= tol(np.float32)["rtol"] and config.routed_bias
    from_hf(src, tmp_path / "ours")
    to_hf(tmp_path / "ours", tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["model_type"] == "kimi_k2" and back["auto_map"] == auto_map
    a, b = _tensors(src), _tensors(tmp_path / "back")
    assert sorted(a) == sorted(b) and all(a[n].tobytes() == b[n].tobytes() for n in a)
    assert config_to_hf(config)["model_type"] == "deepseek_v3"  # without the source config


def _glm() -> dict:
    from hf_models import glm_config

    return glm_config().to_dict()


def _v2() -> dict:
    from hf_models import deepseek_v2_config

    return deepseek_v2_config().to_dict()


BAD = [
    (_glm, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    (_glm, {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    (_glm, {"n_routed_experts": 8, "num_local_experts": 6}, "num_local_experts=6 disagree"),
    (_glm, {"num_nextn_predict_layers": 1, "num_mtp_layers": 2}, "num_mtp_layers=2 and"),
    (
        _glm,
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}},
        "partial_rotary_factor=0.5 .*rope_type=yarn",
    ),
    (_glm, {"o_proj_bias": True}, "o_proj_bias"),
    (_v2, {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    (_v2, {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    (_v2, {"norm_topk_prob": True}, "norm_topk_prob=True with model_type=deepseek_v2"),
    (_v2, {"mlp_bias": True}, "mlp_bias=True"),
    (_v2, {"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1: multi-token"),
    (_v2, {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
]


@pytest.mark.parametrize("base,change,message", BAD, ids=[m for _, _, m in BAD])
def test_unsupported_configs_are_refused(base, change, message):
    """Each refused field is named with its value; the unchanged config converts."""
    assert config_from_hf(base()).decoder_block == "deepseek"
    with pytest.raises(ConversionError, match=message):
        config_from_hf({**base(), **change})


def test_to_hf_refuses_what_glm4_moe_and_deepseek_v2_cannot_hold():
    c = expertax.load_config(overrides={"model_name": "glm4.5-tiny"})
    assert config_to_hf(c)["model_type"] == "glm4_moe"
    for change, message in [
        ({"attention_out_bias": True}, "attention_out_bias=True: .*needs attention_out_bias="),
        ({"routed_bias": False}, "routed_bias=False \\(needs True\\)"),
        ({"routing_group_score": "max"}, "routing_group_score='max' \\(needs 'top2_sum'\\)"),
    ]:
        with pytest.raises(ConversionError, match=message):
            config_to_hf(c.model_copy(update=change))
    v2 = config_from_hf(_v2())
    assert config_to_hf(v2)["model_type"] == "deepseek_v2"
    with pytest.raises(ConversionError, match="norm_topk_prob=true with routed_score_func"):
        config_to_hf(v2.model_copy(update={"norm_topk_prob": True}))
    with pytest.raises(ConversionError, match="mtp_num_layers=1: DeepSeek-V2"):
        config_to_hf(v2.model_copy(update={"mtp_num_layers": 1}))
    grouped = {"n_routing_groups": 4, "topk_routing_group": 2, "routing_group_score": "top2_sum"}
    with pytest.raises(ConversionError, match="routing_group_score='top2_sum' with routed_score"):
        config_to_hf(v2.model_copy(update=grouped))


def test_absent_fields_take_transformers_defaults():
    """A sparse config.json means what it means to transformers (its config class defaults)."""
    from transformers import DeepseekV2Config, Glm4MoeConfig

    from expertax.config.schema import ModelSection, MoESection

    keys = (set(ModelSection.model_fields) | set(MoESection.model_fields)) - {"model_name"}
    # given: DeepseekV2Config has no top-k default; GLM's default head (4096 / 96 = 42 dims, 21
    # rotated) is not one RoPE can rotate in pairs (refused), its published head_dim is 128
    given = {"num_experts_per_tok": 6, "head_dim": 128}
    for model_type, full in (
        ("glm4_moe", Glm4MoeConfig(**given).to_dict()),
        ("deepseek_v2", DeepseekV2Config(**given).to_dict()),
    ):
        sparse = config_from_hf({"model_type": model_type, **given})
        ours = config_from_hf({**full, **given})
        differ = {k for k in keys if getattr(sparse, k) != getattr(ours, k)}
        assert not differ, (model_type, {k: (getattr(sparse, k), getattr(ours, k)) for k in differ})


def test_kimi_and_v2_lite_hub_configs():
    """The published configs of moonshotai/Kimi-K2-Instruct and deepseek-ai/DeepSeek-V2-Lite map
    to the architectures they describe and back."""
    from hub_configs import HUB_DEEPSEEK_V2_LITE, HUB_KIMI_K2

    kimi = config_from_hf(HUB_KIMI_K2)
    assert (kimi.num_experts, kimi.routed_scaling_factor, kimi.n_routing_groups) == (384, 2.827, 1)
    lite = config_from_hf(HUB_DEEPSEEK_V2_LITE)
    assert (lite.q_lora_rank, lite.num_experts, lite.shared_experts) == (0, 64, 2)
    assert lite.routed_score_func == "softmax" and not lite.uses_routing_groups
    for hub, c in ((HUB_KIMI_K2, kimi), (HUB_DEEPSEEK_V2_LITE, lite)):
        back = config_to_hf(c, hub)
        for key, value in hub.items():
            if key in back and key != "torch_dtype":
                assert back[key] == value or float(back[key]) == float(value), key


def test_torch_round_trip_of_bfloat16_glm(tmp_path):
    """bfloat16 (transformers keeps the router and its bias in float32): bit for bit back."""
    model = build("glm-plain", seed=41).to(torch.bfloat16)
    src = save(model, tmp_path / "hf", max_shard_size="40KB")
    config = from_hf(src, tmp_path / "ours")
    assert config.weight_dtype == "bfloat16"
    to_hf(tmp_path / "ours", tmp_path / "back", max_shard_bytes=40_000)
    a, b = _tensors(src), _tensors(tmp_path / "back")
    assert sorted(a) == sorted(b)
    assert all(a[n].dtype == b[n].dtype and a[n].tobytes() == b[n].tobytes() for n in a)
