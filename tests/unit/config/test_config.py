"""Config loading, presets and the table of refused configs."""

import time

import pytest

from expertax.config import Config, ConfigError, configs_dir
from expertax.config.loader import available_models, parse_overrides
from expertax.preflight import load_config
from expertax.sharding import check_mesh_fit, mesh_shape

PRESETS = [
    "deepseek3-tiny",
    "deepseek3-small",
    "deepseek3-671b",
    "mixtral-tiny",
    "mixtral-8x7b",
    "llama-tiny",
    "qwen3-moe-tiny",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "glm4.5-tiny",
    "glm4.5-air",
    "glm4.5",
    "mixtral-8x22b",
]


def test_all_required_presets_exist():
    assert set(PRESETS) <= set(available_models())


@pytest.mark.parametrize("name", available_models())
def test_every_preset_loads_and_fits_a_mesh(name):
    c = load_config(overrides={"model_name": name})
    assert c.model_name == name
    shape = mesh_shape(c, 8)
    check_mesh_fit(c, shape)


def test_deepseek3_671b_has_the_published_dims():
    c = load_config(overrides=["model_name=deepseek3-671b"])
    assert (c.base_num_decoder_layers, c.first_num_dense_layers, c.num_experts) == (61, 3, 256)
    assert (c.num_experts_per_tok, c.shared_experts) == (8, 1)
    assert (
        c.q_lora_rank,
        c.kv_lora_rank,
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
    ) == (1536, 512, 128, 64, 128)
    assert c.rope_type == "yarn" and c.rope_factor == 40


def test_overrides_are_typed_and_compose_over_files(tmp_path):
    f = tmp_path / "mine.yml"
    f.write_text("model_name: mixtral-tiny\nsteps: 7\n")
    c = load_config(f, overrides=["steps=9", "learning_rate=1e-4", "sparse_matmul=false"])
    assert c.model_name == "mixtral-tiny" and c.num_experts == 8
    assert c.steps == 9 and c.learning_rate == 1e-4 and c.sparse_matmul is False
    assert parse_overrides(["a=true", "b=3", "c=x"]) == {"a": True, "b": 3, "c": "x"}


@pytest.mark.parametrize("typed", ["off", "yes", "no", "on", "1e3", "007", "12", "1.5", "null"])
def test_a_string_key_is_what_the_user_typed(typed, tmp_path):
    assert load_config(overrides=[f"run_name={typed}"]).run_name == typed
    f = tmp_path / "mine.yml"
    f.write_text(f"run_name: {typed}\n")
    assert load_config(f).run_name == typed
    # Quoted in a file, YAML already reads text; other kinds of keys keep YAML's reading.
    f.write_text(f"run_name: '{typed}'\nuse_ring_of_experts: off\nsteps: 12\n")
    c = load_config(f, overrides=["learning_rate=3", "sparse_matmul=off"])
    assert c.run_name == typed and c.use_ring_of_experts is False and c.steps == 12
    assert c.learning_rate == 3.0 and c.sparse_matmul is False


def test_a_non_string_key_still_refuses_text():
    with pytest.raises(ConfigError, match="steps='off': expects int, not a yes/no word"):
        load_config(overrides=["steps=off"])
    with pytest.raises(ConfigError, match="learning_rate='on': expects float or int"):
        load_config(overrides=["learning_rate=on"])


def test_configs_dir_holds_models_and_parallel_presets():
    assert (configs_dir() / "parallel" / "default.yml").is_file()


# (overrides, words the message must contain). Each refused by its own check.
INVALID = [
    ({"num_experts": 12, "ici_expert_parallelism": 8}, ["num_experts=12", "expert axis"]),
    ({"ici_fsdp_parallelism": 3}, ["product", "8 devices"]),
    ({"ici_fsdp_parallelism": -1, "ici_data_parallelism": -1}, ["only one", "-1"]),
    ({"num_experts_per_tok": 17}, ["num_experts_per_tok=17", "num_experts=16"]),
    ({"n_routing_groups": 5}, ["n_routing_groups=5", "divide"]),
    ({"topk_routing_group": 9}, ["topk_routing_group=9"]),
    ({"n_routing_groups": 8, "topk_routing_group": 1}, ["num_experts_per_tok=4", "kept groups"]),
    ({"num_expert": 4}, ["unknown key", "num_experts"]),
    ({"learnin_rate": 0.1}, ["unknown key", "learning_rate"]),
    ({"steps": "many"}, ["steps", "integer"]),
    ({"base_emb_dim": -64}, ["base_emb_dim=-64", "greater than 0"]),
    (
        {"base_num_query_heads": 6, "ici_tensor_parallelism": 4, "ici_fsdp_parallelism": 2},
        ["base_num_query_heads=6", "tensor"],
    ),
    ({"model_name": "deepseek3-tiniest"}, ["model_name", "deepseek3-tiny"]),
    ({"dtype": "float8"}, ["dtype", "float32"]),
    ({"first_num_dense_layers": 9}, ["first_num_dense_layers=9"]),
    ({"capacity_factor": 1.25}, ["capacity_factor", "sparse"]),
    ({"capacity_factor": 0, "sparse_matmul": False}, ["capacity_factor=0"]),
    ({"routed_bias": True, "routed_score_func": "softmax"}, ["routed_bias", "sigmoid"]),
    ({"ici_pipeline_parallelism": 3}, ["3 stages", "2 pipelined MoE layers"]),
    ({"num_pipeline_repeats": 2}, ["num_pipeline_repeats=2", "needs pipeline stages"]),
    (
        {"ici_pipeline_parallelism": 2, "num_pipeline_repeats": 2},
        ["2 pipelined MoE layers", "num_pipeline_repeats=2", "2 stages"],
    ),
    (
        {
            "ici_pipeline_parallelism": 2,
            "num_pipeline_repeats": 2,
            "num_pipeline_microbatches": 3,
            "base_num_decoder_layers": 5,
        },
        ["num_pipeline_microbatches=3", "multiple of the 2 stages"],
    ),
    ({"pipeline_parallel_layers": 9}, ["pipeline_parallel_layers=9", "1..2"]),
    ({"num_pipeline_microbatches": 0}, ["num_pipeline_microbatches=0"]),
    # a per-name placement under a preset would be ignored
    (
        {"remat_policy": "full", "moe_mlpwo": "offload"},
        ["moe_mlpwo=offload", "remat_policy=custom"],
    ),
    # the stash's buffers are device memory: an offloaded stashed name would be stashed on device
    (
        {"remat_policy": "custom", "moe_mlpwo": "offload", "moe_paged_stash": True},
        ["moe_mlpwo=offload", "moe_paged_stash=true", "moe_mlpwo=device"],
    ),
    (
        {"ici_pipeline_parallelism": 2, "moe_paged_stash": True},
        ["moe_paged_stash=true", "pipeline"],
    ),
    ({"per_device_batch_size": 0.3}, ["per_device_batch_size", "whole"]),
    (
        {"model_name": "llama-tiny", "base_num_kv_heads": 3},
        ["base_num_query_heads=4", "base_num_kv_heads=3"],
    ),
    ({"attention_type": "mla", "kv_lora_rank": 0}, ["kv_lora_rank=0", "mla"]),
    ({"attention_qk_norm": True}, ["attention_qk_norm=true", "attention_type=mla", "gqa"]),
    ({"rope_type": "yarn", "rope_factor": 1.0}, ["rope_factor"]),
    ({"sharding_rules": "nope"}, ["sharding_rules", "default"]),
    ({"gmm_tile_rows_min": 12}, ["gmm_tile_rows_min=12", "power of two"]),
    ({"gmm_impl": "fp8_hopper"}, ["gmm_impl=fp8_hopper", "quantization=fp8_blockwise"]),
    (
        {"gmm_impl": "fp8_hopper", "quantization": "fp8_blockwise", "base_moe_mlp_dim": 96},
        ["gmm_impl=fp8_hopper", "base_emb_dim=128", "base_moe_mlp_dim=96", "gmm_impl=auto"],
    ),
    ({"synthetic_noise": 1.0}, ["synthetic_noise=1.0", "[0, 1)"]),
    ({"synthetic_noise": -0.1}, ["synthetic_noise=-0.1", "[0, 1)"]),
    (
        {
            "synthetic_noise": 0.3,
            "dataset_type": "files",
            "dataset_path": "d",
            "tokenizer_path": "t",
        },
        ["synthetic_noise=0.3", "dataset_type=files"],
    ),
]


@pytest.mark.parametrize("overrides,words", INVALID, ids=[str(o) for o, _ in INVALID])
def test_invalid_config_is_refused_fast_with_its_own_message(overrides, words):
    from expertax.config import load_rules

    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        c = load_config(overrides=overrides)
        check_mesh_fit(c, mesh_shape(c, 8))
        load_rules(c.sharding_rules)
    assert time.perf_counter() - t0 < 1.0
    msg = str(err.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert "\n" not in msg and len(msg) < 400  # one line; the valid values (16 presets) included


def test_invalid_messages_are_distinct():
    from expertax.config import load_rules

    messages = set()
    for overrides, _ in INVALID:
        try:
            c = load_config(overrides=overrides)
            check_mesh_fit(c, mesh_shape(c, 8))
            load_rules(c.sharding_rules)
        except ConfigError as e:
            messages.add(str(e))
    assert len(messages) == len(INVALID)


def test_valid_default_is_accepted():
    c = load_config()
    check_mesh_fit(c, mesh_shape(c, 8))
    assert c.model_name == "deepseek3-tiny" and c.num_moe_layers == 2 and c.num_dense_layers == 1


def test_every_key_declares_its_kind():
    from expertax.config.schema import KINDS, key_kind, keys_of_kind

    for key in Config.model_fields:
        assert key_kind(key) in KINDS
    assert sum(len(keys_of_kind(k)) for k in KINDS) == len(Config.model_fields)
    # Spot checks of the classification the resume and load checks rely on.
    assert key_kind("base_emb_dim") == key_kind("num_experts") == "model"
    assert key_kind("learning_rate") == "training" and key_kind("dataset_path") == "data"
    assert key_kind("ici_fsdp_parallelism") == key_kind("moe_mlpwo") == "layout"
    assert key_kind("steps") == key_kind("run_name") == "run"


def test_changed_keys_names_only_the_differing_keys_of_the_kinds_asked():
    from expertax.config.schema import MODEL, TRAINING, changed_keys

    c = load_config(overrides={"model_name": "deepseek3-tiny"})
    saved = {**c.model_dump(), "base_emb_dim": 1, "learning_rate": 5.0, "steps": 1}
    assert changed_keys(saved, c, [MODEL]) == [f"base_emb_dim: 1 -> {c.base_emb_dim}"]
    assert len(changed_keys(saved, c, [MODEL, TRAINING])) == 2
    assert changed_keys(c.model_dump(), c, [MODEL, TRAINING]) == []
    # A key missing from an older config.yml counts as its default.
    c8 = load_config(overrides={"model_name": "deepseek3-tiny", "num_experts": 8})
    older = {k: v for k, v in c8.model_dump().items() if k != "num_experts"}
    assert Config.model_fields["num_experts"].default == 16
    assert changed_keys(older, c8, [MODEL]) == ["num_experts: 16 -> 8"]


# A config file's text and the words of its refusal: a key given twice (at the top or inside a
# value), text that is not UTF-8 (a binary file, Latin-1)
BAD_FILES = [
    (b"num_experts: banana\nnum_experts: 16\n", "key 'num_experts' is given twice (lines 1 and 2)"),
    (b"steps: 3\nrope:\n  a: 1\n  a: 2\n", "key 'a' is given twice (lines 3 and 4)"),
    (b"\xf3\x00\x01binary", "is not UTF-8 text (byte 0xf3 at offset 0)"),
    ("run_name: caf\u00e9\n".encode("latin-1"), "is not UTF-8 text (byte 0xe9 at offset 13)"),
]


@pytest.mark.parametrize("content, words", BAD_FILES)
def test_a_config_file_that_cannot_be_taken_as_it_is_is_refused(content, words, tmp_path):
    f = tmp_path / "mine.yml"
    f.write_bytes(content)
    with pytest.raises(ConfigError, match="config file") as e:
        load_config(f)
    assert words in str(e.value), str(e.value)


def test_a_config_path_that_is_no_file_says_what_it_is(tmp_path):
    (tmp_path / "d.yml").mkdir()
    for path, words in (
        (tmp_path / "d.yml", "is a folder"),
        ("/dev/null", "is a character device"),
    ):
        with pytest.raises(ConfigError, match=words):
            load_config(path)
    merged = tmp_path / "merge.yml"  # YAML's merge key may be given again: not a duplicate
    merged.write_text("base: &b {steps: 3}\nother:\n  <<: *b\n  steps: 4\n")
    with pytest.raises(ConfigError, match="unknown key 'base'"):
        load_config(merged)


def test_a_key_given_twice_on_the_command_line_is_refused():
    """Which of two values was meant cannot be told: refused, the first one unchecked or not."""
    for items in (["num_experts=banana", "num_experts=16"], ["steps=2", "steps=2"]):
        with pytest.raises(ConfigError, match=f"{items[0].split('=')[0]} is given twice"):
            parse_overrides(items)
    assert parse_overrides(["steps=2", "num_experts=8"]) == {"steps": 2, "num_experts": 8}
