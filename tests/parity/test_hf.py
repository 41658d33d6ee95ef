"""HuggingFace parity: tiny random DeepSeek-V3, Mixtral and Qwen3-MoE models, converted both
ways."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="parity tests need torch (pip install expertax[parity])")
pytest.importorskip("transformers", reason="parity tests need transformers (extra 'parity')")

import torch  # noqa: E402
from hf_models import build, hf_logits, prompt, save  # noqa: E402
from hub_configs import (  # noqa: E402
    HUB_DEEPSEEK_V3,
    HUB_GLM_45,
    HUB_GLM_45_AIR,
    HUB_MIXTRAL_8X7B,
    HUB_MIXTRAL_8X22B,
    HUB_QWEN3_30B_A3B,
    HUB_QWEN3_235B_A22B,
)
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from tests.tolerances import tol  # noqa: E402

import expertax  # noqa: E402
from expertax.convert import ConversionError, config_from_hf, from_hf, to_hf, write_hf  # noqa: E402
from expertax.convert.safetensors_io import INDEX_FILE, iter_tensors  # noqa: E402

pytestmark = pytest.mark.parity

# Max abs logit difference, expertax (JAX, highest matmul precision) vs transformers, per dtype.
TOLERANCE = {"float32": 1e-4}
# A wrong layout must miss by far more than the tolerance (negative controls).
MISS = 1e-2

VARIANTS = ["deepseek-qlora", "deepseek-plain-q", "mixtral", "mixtral-tied", "qwen3", "qwen3-yarn"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, tuple[Path, np.ndarray]]:
    """Each variant saved once (q-LoRA DeepSeek with the hub's rope_scaling style), with its
    reference logits for `prompt()`."""
    out = {}
    for i, kind in enumerate(VARIANTS):
        model = build(kind, seed=i)
        path = tmp_path_factory.mktemp(kind)
        save(model, path, hub_rope_style=kind == "deepseek-qlora")
        out[kind] = (path, hf_logits(model, prompt()))
    return out


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize("kind", VARIANTS)
def test_logits_match_transformers(hf_dirs, kind):
    path, ref = hf_dirs[kind]
    config, params = expertax.load_hf(path)
    out = expertax.logits(params, prompt().numpy(), config)
    assert out.shape == ref.shape and out.dtype == np.float32
    diff = _max_diff(out, ref)
    print(f"\n{kind}: max |logits diff| = {diff:.3g} (logits scale {np.abs(ref).max():.3g})")
    assert diff <= TOLERANCE["float32"]
    assert config.logits_via_embedding == (kind == "mixtral-tied") == (params.lm_head is None)
    if kind.startswith("deepseek"):
        assert config.rope_type == "yarn" and config.uses_routing_groups
        assert config.num_dense_layers == 1 and config.shared_experts == 1
        # Negative control: the routing bias must matter (it changes the chosen experts).
        bias = params.moe_layers.moe.router.bias
        assert float(np.abs(bias).min()) > 0
        router = dataclasses.replace(params.moe_layers.moe.router, bias=bias * 0)
        moe = dataclasses.replace(params.moe_layers.moe, router=router)
        no_bias = dataclasses.replace(
            params, moe_layers=dataclasses.replace(params.moe_layers, moe=moe)
        )
        assert _max_diff(expertax.logits(no_bias, prompt().numpy(), config), ref) > MISS
    if kind.startswith("qwen3"):
        _check_qwen3(kind, config, params, out, ref)


def _with_attn(params, **change):
    layers = params.moe_layers
    attn = dataclasses.replace(layers.attn, **change)
    return dataclasses.replace(params, moe_layers=dataclasses.replace(layers, attn=attn))


def _check_qwen3(kind, config, params, out, ref):
    """Within float32's relative tolerance of the logits' scale; the dims line up nowhere; each
    q/k norm scale is read where transformers reads it: 5 % more on one channel of one layer
    misses (negative controls, on the first variant)."""
    assert config.decoder_block == "qwen3" and config.attention_qk_norm
    assert config.head_dim == 24 != config.base_emb_dim // config.base_num_query_heads
    assert 2 * config.base_moe_mlp_dim != config.base_emb_dim and config.num_experts_per_tok == 3
    assert config.norm_topk_prob == (kind == "qwen3")
    assert config.rope_type == ("yarn" if kind == "qwen3-yarn" else "default")
    relative = _max_diff(out, ref) / float(np.max(np.abs(ref)))
    print(f"{kind}: max |logits diff| / max |logit| = {relative:.3g}")
    assert relative <= tol(np.float32)["rtol"]
    if kind != "qwen3":
        return  # the controls once: the yarn variant reads the norms the same way
    import jax

    tokens = prompt().numpy()
    forward = jax.jit(lambda p: expertax.logits(p, tokens, config))  # one compile for both
    for name in ("q_norm", "k_norm"):
        scale_LQ = getattr(params.moe_layers.attn, name)
        assert float(np.std(scale_LQ)) > 0.1  # not all ones
        changed = _with_attn(params, **{name: scale_LQ.at[1, 0].multiply(1.05)})
        assert _max_diff(forward(changed), ref) > MISS, name


def test_rope_layout_negative_control(hf_dirs, tmp_path):
    """Reading interleaved RoPE weights as half-split (rope_interleave=false) must fail parity."""
    path, ref = hf_dirs["deepseek-plain-q"]
    for f in path.iterdir():
        (tmp_path / f.name).symlink_to(f)
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_interleave": False}))
    config, params = expertax.load_hf(tmp_path)
    assert _max_diff(expertax.logits(params, prompt().numpy(), config), ref) > MISS


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return dict(iter_tensors(path))


def _assert_bitwise_equal(a: Path, b: Path) -> int:
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert ta[name].shape == tb[name].shape, name
        assert ta[name].tobytes() == tb[name].tobytes(), name
    return len(ta)


def test_round_trip_is_bitwise_sharded_bfloat16(tmp_path):
    """to-hf(from-hf(x)) == x for every tensor; sharded bf16 in, sharded out, index files."""
    model = build("deepseek-qlora", seed=5).to(torch.bfloat16)
    src = save(model, tmp_path / "hf", max_shard_size="40KB")
    assert (src / INDEX_FILE).is_file()
    config = from_hf(src, tmp_path / "ours")
    assert config.weight_dtype == "bfloat16"
    to_hf(tmp_path / "ours", tmp_path / "back", max_shard_bytes=40_000)
    assert (tmp_path / "back" / INDEX_FILE).is_file()
    n = _assert_bitwise_equal(src, tmp_path / "back")
    assert n > 50
    weight_map = json.loads((tmp_path / "back" / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    with safe_open(tmp_path / "back" / weight_map["lm_head.weight"], "numpy") as f:
        assert f.metadata() == {"format": "pt"}
    # Negative control: the comparison sees a one-ulp change in one tensor.
    changed = tmp_path / "changed"
    changed.mkdir()
    tensors = _tensors(tmp_path / "back")
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    bits = tensors[name].view(np.uint16).copy()
    bits[0] ^= 1
    tensors[name] = bits.view(tensors[name].dtype)
    save_file(tensors, str(changed / "model.safetensors"))
    with pytest.raises(AssertionError):
        _assert_bitwise_equal(src, changed)


@pytest.mark.parametrize(
    "preset", ["deepseek3-tiny", "mixtral-tiny", "qwen3-moe-tiny", "glm4.5-tiny"]
)
def test_transformers_loads_to_hf_output(tmp_path, preset):
    """An expertax-native model written by to-hf loads in transformers with the same logits."""
    import jax
    from transformers import AutoModelForCausalLM

    config = expertax.load_config(overrides={"model_name": preset})
    # numpy draws (init_params compiles a slow threefry program on CPU); unit-scale weights and
    # a nonzero routing bias, like the HF-side models.
    from expertax.models import decoder
    from expertax.nn.param import is_spec

    rng = np.random.default_rng(3)
    draw = {
        "normal": lambda s: s.scale * rng.standard_normal(s.shape),
        "ones": lambda s: 1.0 + 0.2 * rng.standard_normal(s.shape),
        "zeros": lambda s: 0.1 * rng.standard_normal(s.shape),  # the routing bias
    }
    params = jax.tree.map(
        lambda s: draw[s.init](s).astype(np.float32), decoder.spec(config), is_leaf=is_spec
    )
    assert config.routed_bias == (params.moe_layers.moe.router.bias is not None)
    write_hf(params, config, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = torch.randint(
        0, config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(1)
    )
    ref = hf_logits(model, tokens)
    diff = _max_diff(expertax.logits(params, tokens.numpy(), config), ref)
    print(f"\nto-hf {preset}: max |logits diff| = {diff:.3g}")
    assert diff <= TOLERANCE["float32"]
    # and back: from-hf of the written checkpoint gives the same parameters, bitwise
    back_config, back = expertax.load_hf(tmp_path)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    from expertax.config.schema import ModelSection, MoESection

    # Model keys survive the trip; training-only keys have no HF field.
    skip = {
        "model_name",
        "load_balance_loss_weight",
        "routed_bias_update_rate",
        "sparse_matmul",
        "capacity_factor",
        "use_random_routing",
        "float32_weight_sum",
        "gmm_impl",
    }
    if config.num_dense_layers == 0:
        skip.add("base_mlp_dim")  # unused without dense layers
    keys = (set(ModelSection.model_fields) | set(MoESection.model_fields)) - skip
    assert {k: getattr(back_config, k) for k in keys} == {k: getattr(config, k) for k in keys}


@pytest.mark.parametrize("kind", ["deepseek-plain-q", "qwen3"])
def test_fused_expert_layout_is_read(hf_dirs, tmp_path, kind, monkeypatch):
    """transformers >= 5 in-memory names (experts.gate_up_proj / down_proj) convert the same,
    whole or in units of a few experts (CHUNK_BYTES lowered)."""
    path, _ = hf_dirs[kind]
    t = _tensors(path)
    fused: dict[str, np.ndarray] = {}
    per_expert: dict[tuple[str, int], dict[int, np.ndarray]] = {}
    for name, x in t.items():
        parts = name.split(".")
        if ".mlp.experts." in name:
            layer, j, proj = parts[2], int(parts[5]), parts[6]
            per_expert.setdefault((layer, proj), {})[j] = x
        else:
            fused[name] = x
    for (layer, proj), xs in per_expert.items():
        stacked = np.stack([xs[j] for j in sorted(xs)])
        if proj == "down_proj":
            fused[f"model.layers.{layer}.mlp.experts.down_proj"] = stacked
    for layer in {layer for layer, _ in per_expert}:
        g, u = per_expert[(layer, "gate_proj")], per_expert[(layer, "up_proj")]
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([g[j], u[j]]) for j in sorted(g)]
        )
    save_file(fused, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    _, a = expertax.load_hf(path)
    _, b = expertax.load_hf(tmp_path)
    from expertax.convert import hf_read

    gate_up = next(x for n, x in fused.items() if n.endswith("gate_up_proj"))
    monkeypatch.setattr(hf_read, "CHUNK_BYTES", 3 * gate_up[0].nbytes)  # 3 experts a unit
    _, split = expertax.load_hf(tmp_path)
    import jax

    for x, y, z in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(split), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes() == np.asarray(z).tobytes()


def test_cli_round_trip(hf_dirs, tmp_path):
    path, _ = hf_dirs["mixtral"]
    env = {**os.environ, "PYTHONPATH": str(Path(expertax.__file__).parents[1])}
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "expertax.cli", "convert", *map(str, a)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    r = run("from-hf", path, tmp_path / "ours")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ours" / "config.yml").is_file()
    r = run("to-hf", tmp_path / "ours", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    _assert_bitwise_equal(path, tmp_path / "back")
    r = run("from-hf", path, tmp_path / "ours")  # not empty: refused, one line, status 2
    assert r.returncode == 2 and "not empty" in r.stderr and "Traceback" not in r.stderr
    r = run("to-hf", tmp_path / "ours", tmp_path / "back")  # never overwrites
    assert r.returncode == 2 and "not empty" in r.stderr
    r = run("to-hf", path, tmp_path / "other")  # an HF directory is not an expertax one
    assert r.returncode == 2 and "not an expertax model directory" in r.stderr
    # the converted directory is a usable config for the trainer
    cfg = expertax.load_config(tmp_path / "ours" / "config.yml")
    assert cfg.decoder_block == "mixtral" and cfg.num_experts == 4


def _ds_config() -> dict:
    from hf_models import deepseek_config

    return deepseek_config(q_lora_rank=24).to_dict()


BAD_CONFIGS = [
    ("qwen2_moe", {"model_type": "qwen2_moe"}, "model_type"),
    ("llama", {"model_type": "llama"}, "model_type"),
    ("fp8", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ("gelu", {"hidden_act": "gelu"}, "hidden_act"),
    ("attention bias", {"attention_bias": True}, "attention_bias"),
    ("rope linear", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    (
        "attention_factor",
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 2.0}},
        "attention_factor",
    ),
    ("scoring softmax", {"scoring_func": "softmax"}, "scoring_func"),
    ("unknown field", {"some_new_feature": 3}, "some_new_feature"),
    ("gqa kv heads", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("dropout", {"attention_dropout": 0.1}, "attention_dropout"),
    ("top-1 normalized", {"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
]


@pytest.mark.parametrize("name,change,field", BAD_CONFIGS, ids=[b[0] for b in BAD_CONFIGS])
def test_unsupported_configs_are_refused(name, change, field):
    hf = {**_ds_config(), **change}
    with pytest.raises(ConversionError, match=field):
        config_from_hf(hf)


def test_unsupported_mixtral_sliding_window_and_tensor_errors(hf_dirs, tmp_path):
    from hf_models import mixtral_config

    with pytest.raises(ConversionError, match="sliding_window"):
        config_from_hf({**mixtral_config().to_dict(), "sliding_window": 4096})
    with pytest.raises(ConversionError, match="num_experts_per_tok=1"):
        config_from_hf({**mixtral_config().to_dict(), "num_experts_per_tok": 1})
    path, _ = hf_dirs["mixtral"]
    t = _tensors(path)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(
        {k: v for k, v in t.items() if k != "model.norm.weight"},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ConversionError, match="lacks tensors model.norm.weight"):
        expertax.load_hf(tmp_path)
    save_file(
        {**t, "model.layers.0.self_attn.q_norm.weight": t["model.norm.weight"]},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ConversionError, match="q_norm.weight .*no place"):
        expertax.load_hf(tmp_path)


def _qwen3_config() -> dict:
    from hf_models import qwen3_config

    return qwen3_config().to_dict()


QWEN3_BAD_CONFIGS = [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window=True"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers=\\[1\\]"),
    ({"num_experts": 8}, "num_experts=8 and num_local_experts=6 disagree"),
    ({"num_local_experts": 1}, "num_experts=1"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
    ({"num_experts_per_tok": 1, "norm_topk_prob": True}, "num_experts_per_tok=1"),
    ({"qkv_bias": True}, "qkv_bias"),
]


@pytest.mark.parametrize("change,message", QWEN3_BAD_CONFIGS, ids=[m for _, m in QWEN3_BAD_CONFIGS])
def test_unsupported_qwen3_configs_are_refused(change, message):
    """Each refused qwen3_moe field is named with its value; the unchanged config converts."""
    assert config_from_hf(_qwen3_config()).attention_qk_norm
    with pytest.raises(ConversionError, match=message):
        config_from_hf({**_qwen3_config(), **change})


def test_to_hf_refuses_what_the_hf_family_cannot_hold():
    """to-hf names the keys a family's HF layout has no place for: Qwen3-MoE without the q/k
    norm or with a routing bias, Mixtral with the q/k norm (its tensors would be dropped)."""
    from expertax.convert import config_to_hf

    qwen = expertax.load_config(overrides={"model_name": "qwen3-moe-tiny"})
    assert config_to_hf(qwen)["model_type"] == "qwen3_moe"
    with pytest.raises(ConversionError, match="attention_qk_norm=False \\(needs True\\)"):
        config_to_hf(qwen.model_copy(update={"attention_qk_norm": False}))
    biased = {"routed_score_func": "sigmoid", "routed_bias": True}
    with pytest.raises(ConversionError, match="routed_bias=True \\(needs False\\)"):
        config_to_hf(qwen.model_copy(update=biased))
    mixtral = expertax.load_config(overrides={"model_name": "mixtral-tiny"})
    with pytest.raises(ConversionError, match="attention_qk_norm=false"):
        config_to_hf(mixtral.model_copy(update={"attention_qk_norm": True}))


def test_qwen3_round_trip_is_bitwise(tmp_path):
    """Qwen3-MoE from-hf then to-hf: every tensor bit for bit (bfloat16, sharded), the config's
    model fields and the hub's context length kept; transformers reads the result back into
    the same model (its logits equal the source's exactly)."""
    from transformers import AutoModelForCausalLM

    model = build("qwen3", seed=11).to(torch.bfloat16)
    src = save(model, tmp_path / "hf", max_shard_size="40KB")
    hub_style = json.loads((src / "config.json").read_text())
    hub_style["max_position_embeddings"] = 40960
    (src / "config.json").write_text(json.dumps(hub_style))
    config = from_hf(src, tmp_path / "ours")
    assert config.decoder_block == "qwen3" and config.weight_dtype == "bfloat16"
    to_hf(tmp_path / "ours", tmp_path / "back", max_shard_bytes=40_000)
    assert _assert_bitwise_equal(src, tmp_path / "back") == 3 + 2 * (4 + 2 + 2 + 1 + 3 * 6)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["max_position_embeddings"] == 40960
    renamed = {"num_local_experts": "num_experts", "dtype": "torch_dtype"}
    # what transformers' own options and version say is not the model's
    other = {"rope_parameters", "transformers_version", "use_cache", "output_router_logits"}
    for key, value in hub_style.items():
        if key not in other:
            assert back[renamed.get(key, key)] == value, key
    assert back["rope_theta"] == hub_style["rope_parameters"]["rope_theta"]
    tokens = prompt()
    model = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    np.testing.assert_array_equal(hf_logits(again.eval(), tokens), hf_logits(model, tokens))


@pytest.mark.parametrize(
    "hub,preset",
    [
        (HUB_DEEPSEEK_V3, "deepseek3-671b"),
        (HUB_MIXTRAL_8X7B, "mixtral-8x7b"),
        (HUB_MIXTRAL_8X22B, "mixtral-8x22b"),
        (HUB_QWEN3_30B_A3B, "qwen3-30b-a3b"),
        (HUB_QWEN3_235B_A22B, "qwen3-235b-a22b"),
        (HUB_GLM_45, "glm4.5"),
        (HUB_GLM_45_AIR, "glm4.5-air"),
    ],
)
def test_hub_configs_map_to_our_presets(hub, preset):
    from expertax.config.schema import ModelSection, MoESection
    from expertax.convert import config_to_hf

    ours = config_from_hf(hub)
    # the hub's DeepSeek-V3 and GLM-4.5 have one multi-token-prediction layer; the presets
    # train without
    mtp = hub.get("num_nextn_predict_layers", 0)
    want = expertax.load_config(overrides={"model_name": preset, "mtp_num_layers": mtp})
    unused = {"model_name", "load_balance_loss_weight", "base_mlp_dim", "head_dim", "mscale"}
    keys = set(ModelSection.model_fields) | set(MoESection.model_fields)
    differ = {k for k in keys if getattr(ours, k) != getattr(want, k)}
    # head_dim is unused by MLA, base_mlp_dim by Mixtral; the rest are training-only keys
    assert differ <= unused | {"routed_bias_update_rate", "gmm_impl", "sparse_matmul"}, differ
    back = config_to_hf(ours, hub)
    for key, value in hub.items():
        if key in back and key != "torch_dtype":
            assert back[key] == value or float(back[key]) == float(value), key
    with pytest.raises(ConversionError, match="quantization_config"):
        config_from_hf({**hub, "quantization_config": {"quant_method": "fp8"}})


def test_router_matches_hf_group_limited_routing():
    """Our router picks the experts and weights of HF's DeepseekV3TopkRouter, also with biases
    pushing many biased scores below zero (where masking with 0.0 instead of -inf would differ)."""
    import jax.numpy as jnp
    from hf_models import deepseek_config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from expertax.nn.moe import router as ours
    from expertax.preflight import build_config

    hf_cfg = deepseek_config(q_lora_rank=None)
    hf_router = DeepseekV3TopkRouter(hf_cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        hf_router.weight.copy_(torch.randn(hf_router.weight.shape, generator=g) / 8)
        hf_router.e_score_correction_bias.copy_(torch.randn(8, generator=g) - 0.7)
    x = torch.randn(512, 64, generator=g)
    _, w_hf, idx_hf = hf_router(x)
    config = build_config(dict(config_from_hf(hf_cfg.to_dict()).model_dump()))
    p = ours.Router(
        w=jnp.asarray(hf_router.weight.detach().numpy().T),
        bias=jnp.asarray(hf_router.e_score_correction_bias.numpy()),
    )
    r = ours.route(p, jnp.asarray(x.numpy()), config)
    order_hf = np.argsort(idx_hf.numpy(), -1)
    order = np.argsort(np.asarray(r.experts_NK), -1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(r.experts_NK), order, -1),
        np.take_along_axis(idx_hf.numpy(), order_hf, -1),
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(r.weights_NK), order, -1),
        np.take_along_axis(w_hf.detach().numpy(), order_hf, -1),
        rtol=1e-6,
        atol=1e-7,
    )
    biased = 1 / (1 + np.exp(-(x.numpy() @ hf_router.weight.detach().numpy().T)))
    assert np.mean(biased + hf_router.e_score_correction_bias.numpy() < 0) > 0.2


def test_converted_directory_restores_sharded(hf_dirs, tmp_path):
    """The trainer's way in: params/ restores into the shardings of an 8-device fsdp mesh."""
    import jax

    from expertax.config import load_rules
    from expertax.models import decoder
    from expertax.nn import param
    from expertax.sharding import make_mesh
    from expertax.train import model_dir as store

    path, _ = hf_dirs["deepseek-qlora"]
    from_hf(path, tmp_path / "ours")
    config, on_one, _ = store.load(tmp_path / "ours")
    mesh = make_mesh(config)
    assert mesh.devices.size == 8
    shardings = param.shardings(decoder.spec(config), mesh, load_rules(config.sharding_rules))
    _, sharded, hf = store.load(tmp_path / "ours", shardings)
    assert hf["model_type"] == "deepseek_v3"
    wq_b = sharded.moe_layers.attn.wq_b
    assert wq_b.sharding == shardings.moe_layers.attn.wq_b
    assert len({s.device for s in wq_b.addressable_shards}) == 8
    for a, b in zip(jax.tree.leaves(on_one), jax.tree.leaves(sharded), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_from_hf_holds_the_model_once(tmp_path):
    """from-hf's reading holds the model plus one tensor; its Orbax save adds no copy (Orbax's
    default deep-copies every numpy leaf first: that would add the whole model)."""
    import tracemalloc

    from expertax.convert import params_from_hf
    from expertax.train import model_dir as store

    path = save(build("deepseek-qlora", seed=9), tmp_path / "hf")
    model_bytes = sum(x.nbytes for _, x in iter_tensors(path))
    largest = max(x.nbytes for _, x in iter_tensors(path))
    store.save(tmp_path / "warm-up", *params_from_hf(path)[:2], source="test")
    tracemalloc.start()
    try:
        config, params, _ = params_from_hf(path)
        _, read_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        store.save(tmp_path / "ours", config, params, source="test")
        _, save_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read_peak < model_bytes + 2 * largest + 2**19, (read_peak, model_bytes, largest)
    assert save_peak - before < model_bytes / 2, (save_peak - before, model_bytes)


def test_absent_fields_take_transformers_defaults():
    """A sparse config.json means what it means to transformers (its config class defaults)."""
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    from expertax.config.schema import ModelSection, MoESection

    keys = (set(ModelSection.model_fields) | set(MoESection.model_fields)) - {"model_name"}
    for model_type, cls in (
        ("mixtral", MixtralConfig),
        ("deepseek_v3", DeepseekV3Config),
        ("qwen3_moe", Qwen3MoeConfig),
    ):
        sparse = config_from_hf({"model_type": model_type})
        full = config_from_hf({**cls().to_dict(), "num_nextn_predict_layers": 0})
        differ = {k for k in keys if getattr(sparse, k) != getattr(full, k)}
        assert not differ, (model_type, {k: (getattr(sparse, k), getattr(full, k)) for k in differ})
