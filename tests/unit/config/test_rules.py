"""The rules between keys, as tables: a key that applies only under another setting is refused
without it (and taken with it); the files and folders a run reads are checked for existence and
kind; the backend-dependent choices are checked against the mesh's platform before tracing."""

from __future__ import annotations

import typing

import pytest

from expertax import preflight
from expertax.config import Config, ConfigError
from expertax.config.checks.only_with import ONLY_WITH
from expertax.nn.moe import strategy
from expertax.preflight import build_config, check_paths, load_config
from expertax.sharding.mesh import make_mesh

# What turns each ONLY_WITH rule on (with what that setting itself needs), by its `setting`.
TURN_ON = {
    "rope_type=yarn": {"rope_type": "yarn", "rope_factor": 4.0},
    "mlp_activation=swiglu_clamped": {"mlp_activation": "swiglu_clamped"},
    "routed_bias=true": {"routed_bias": True, "routed_score_func": "sigmoid"},
    "n_routing_groups > 1": {"n_routing_groups": 4, "topk_routing_group": 2},
    "mtp_num_layers > 0": {"mtp_num_layers": 1},
    "enable_checkpointing=true": {"enable_checkpointing": True},
    "moe_paged_stash=true": {
        "moe_paged_stash": True,
        "remat_policy": "custom",
        "moe_mlpwi_0": "device",
        "moe_mlpwi_1": "device",
        "moe_mlpwo": "device",
    },
    "dataset_type=files": {
        "dataset_type": "files",
        "dataset_path": "data.jsonl",
        "tokenizer_path": "tokenizer.json",
    },
    "dataset_type=files or eval_dataset_path": {
        "eval_interval": 10,
        "eval_dataset_path": "eval.jsonl",
        "tokenizer_path": "tokenizer.json",
    },
    "eval_interval > 0": {"eval_interval": 10, "tokenizer_path": "tokenizer.json"},
    "opt_type=muon": {"opt_type": "muon"},
    "use_qk_clip=true": {"use_qk_clip": True, "model_name": "deepseek3-tiny"},  # MLA only
}

# Keys whose default + 2 (or a file name) is out of their range.
OTHER_VALUES = {"muon_beta": 0.9, "muon_ns_dtype": "bfloat16"}


# Settings on by default, and what turns them off.
TURN_OFF = {"enable_checkpointing=true": {"enable_checkpointing": False}}


def other_value(key: str):
    """A valid value of `key` other than its default."""
    if key in OTHER_VALUES:
        return OTHER_VALUES[key]
    field = Config.model_fields[key]
    default = field.default
    if typing.get_origin(field.annotation) is typing.Literal:
        return next(v for v in typing.get_args(field.annotation) if v != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default + 2
    return f"{key}.jsonl"


ONLY_WITH_CASES = [(rule.setting, key) for rule in ONLY_WITH for key in rule.keys]


def test_every_rule_has_a_setting_to_turn_it_on():
    assert {rule.setting for rule in ONLY_WITH} == set(TURN_ON)
    assert len(ONLY_WITH_CASES) >= 15


@pytest.mark.parametrize("setting, key", ONLY_WITH_CASES)
def test_a_key_without_its_setting_is_refused_and_taken_with_it(setting, key):
    value = other_value(key)
    base = {"tokenizer_path": "tokenizer.json"} if key == "eval_dataset_path" else {}
    base["model_name"] = "mixtral-tiny"  # a preset with every rule's setting off
    base.update(TURN_OFF.get(setting, {}))  # but for settings on by default
    with pytest.raises(ConfigError) as e:
        load_config(overrides={**base, key: value})
    message = str(e.value)
    assert message.startswith(f"{key}={value!r}") and setting in message, message
    # controls: with the setting on, the same value is taken; a whole config (a flat mapping,
    # not the user's words) is not held to the table
    turned_on = load_config(overrides={**base, **TURN_ON[setting], key: value})
    assert getattr(turned_on, key) == value
    assert getattr(build_config({**base, key: value}), key) == value


def test_a_presets_value_is_kept_when_its_setting_is_turned_off():
    """deepseek3-tiny's preset carries YaRN's factor; turning YaRN off on the command line keeps
    it without a refusal, while the user's own factor without YaRN is refused."""
    c = load_config(overrides={"model_name": "deepseek3-tiny", "rope_type": "default"})
    assert c.rope_type == "default" and c.rope_factor == 4.0
    with pytest.raises(ConfigError, match="rope_factor=8.0 applies only with rope_type=yarn"):
        load_config(overrides={"model_name": "mixtral-tiny", "rope_factor": 8.0})


# Values the checks refuse though the schema's bounds take them: (overrides, words of the message)
CROSS_KEY = [
    ({"n_routing_groups": 0}, ["n_routing_groups=0", "-1 (off)"]),
    ({"topk_routing_group": 0}, ["topk_routing_group=0", "-1 (off)"]),
    ({"n_routing_groups": 1, "topk_routing_group": 3}, ["topk_routing_group=3", "> 1"]),
    ({"ici_tensor_parallelism": 0}, ["ici_tensor_parallelism=0", "-1 (the rest)"]),
    ({"num_pipeline_microbatches": 0}, ["num_pipeline_microbatches=0", "-1"]),
    ({"pipeline_parallel_layers": 0}, ["pipeline_parallel_layers=0", "-1"]),
    ({"run_name": "a/b"}, ["run_name='a/b'", "path separators"]),
    ({"run_name": ".."}, ["run_name='..'", "one folder"]),
    ({"run_name": "[a,b]"}, ["run_name='[a,b]'", "holds ',', '[', ']'", "letters, digits"]),
    ({"run_name": "my run"}, ["run_name='my run'", "holds ' '"]),
    ({"run_name": "a" * 256}, ["is 256 bytes long", "at most 255"]),
    ({"run_name": "é" * 128}, ["is 256 bytes long"]),  # counted in UTF-8 bytes, not characters
    ({"coordinator_address": "node0"}, ["coordinator_address='node0'", "host:port"]),
    ({"coordinator_address": "node0:99999"}, ["coordinator_address='node0:99999'", "1..65535"]),
    ({"dataset_type": "files"}, ["dataset_path", "tokenizer_path"]),
    ({"eval_interval": 5, "eval_dataset_path": "e.jsonl"}, ["eval_dataset_path", "tokenizer"]),
]


@pytest.mark.parametrize("overrides, words", CROSS_KEY)
def test_a_cross_key_mistake_is_refused_with_its_keys(overrides, words):
    with pytest.raises(ConfigError) as e:
        build_config(overrides)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_valid_neighbours_of_the_cross_key_cases_are_taken():
    """Negative controls of the table: the nearest valid values."""
    for overrides in (
        {"n_routing_groups": 1, "topk_routing_group": 1},
        {"run_name": "moe-ep8"},
        {"run_name": "ünïcødé_v1.2+b@host"},  # letters of any script, digits, - _ . + @
        {"run_name": "a" * 255},
        {"coordinator_address": "node0:1234"},
        {"ici_tensor_parallelism": -1, "ici_fsdp_parallelism": 1},
    ):
        build_config(overrides)


def _files(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a b"}\n')
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.yml").write_text("{}")
    return {
        "dataset_type": "files",
        "dataset_path": str(data),
        "tokenizer_path": str(tok),
        "eval_interval": 5,
        "eval_dataset_path": str(tmp_path / "*.jsonl"),
        "load_parameters_path": str(model),
        "base_output_directory": str(tmp_path / "runs"),
    }


def _path_cases(tmp_path) -> list[tuple[dict, str]]:
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty").mkdir()
    return [
        ({"dataset_path": str(tmp_path / "nope.jsonl")}, "dataset_path="),
        ({"dataset_path": str(tmp_path / "*.parquet")}, "dataset_path="),
        ({"eval_dataset_path": str(tmp_path / "held_out")}, "eval_dataset_path="),
        ({"tokenizer_path": str(tmp_path / "empty")}, "without tokenizer.json"),
        ({"tokenizer_path": str(tmp_path / "nope.json")}, "tokenizer_path="),
        ({"load_parameters_path": str(tmp_path / "afile")}, "load_parameters_path="),
        ({"load_parameters_path": str(tmp_path / "empty")}, "without config.yml"),
        ({"load_parameters_path": str(tmp_path / "nope")}, "no such folder"),
        ({"base_output_directory": str(tmp_path / "afile")}, "base_output_directory="),
        ({"base_output_directory": str(tmp_path / "afile" / "sub")}, "on its way is a file"),
        ({"base_output_directory": "/proc/expertax-runs"}, "no folder can be made in '/proc'"),
        ({"base_output_directory": "/dev/null"}, "is a character device; runs are written"),
        ({"tokenizer_path": "/dev/null"}, "it is a character device, not a file"),
        ({"dataset_path": "/dev/null"}, "dataset_path='/dev/null' is a character device"),
        ({"load_parameters_path": "/dev/null"}, "'/dev/null': a character device; give"),
    ]


def test_every_path_mistake_is_refused_naming_the_key(tmp_path):
    good = _files(tmp_path)
    check_paths(build_config(good))  # control: the same keys with real files pass
    cases = _path_cases(tmp_path)
    for overrides, words in cases:
        c = build_config({**good, **overrides})
        with pytest.raises(ConfigError, match=words):
            check_paths(c)
    assert len(cases) == 15
    assert not list(tmp_path.glob(".expertax-check-*"))  # the probe folder is gone


def test_ragged_all_to_all_is_refused_on_a_cpu_mesh_before_tracing():
    """XLA:CPU has no ragged all-to-all: refused by preflight with the mesh (nothing traced)."""
    over = {"a2a_impl": "ragged", "ici_expert_parallelism": 8, "ici_fsdp_parallelism": 1}
    c = build_config(over)  # the config alone does not know the platform
    mesh = make_mesh(c)
    with pytest.raises(ConfigError, match=r"a2a_impl=ragged .*expert=8.* on cpu.*padded"):
        preflight.check(c, mesh)
    for fine in ({"a2a_impl": "padded"}, {"a2a_impl": "auto"}, {"use_ring_of_experts": True}):
        preflight.check(build_config({**over, **fine}), mesh)  # controls
    strategy.check_exchange(c, "gpu", {"expert": 8})  # GPU and TPU have it
    strategy.check_exchange(c, "tpu", {"expert": 8})
    strategy.check_exchange(c, "cpu", {"expert": 1, "fsdp": 8})  # no exchange without EP


def test_a_target_without_its_compiler_names_the_extra(monkeypatch):
    """Without the gpu extra there is no `jax_plugins` package at all: find_spec of the dotted
    name raises instead of returning None; both mean "not installed"."""
    import importlib.util

    from expertax import targets

    real = importlib.util.find_spec

    def absent(name, *args):
        if name.startswith("jax_plugins"):
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", absent)
    with pytest.raises(ConfigError, match=r"--target=gpu:h100x8: .*pip install 'expertax\[gpu\]'"):
        targets.check_compiler(targets.parse_target("gpu:h100x8"))
    targets.check_compiler(targets.parse_target("cpu"))  # control: the CPU needs no extra


def test_a_saved_config_given_back_as_a_file_passes(tmp_path):
    """A run's config.yml repeats its preset's values (YaRN's factor with YaRN turned off); given
    back as a file it loads; the same file with the factor changed is refused."""
    from expertax.config import config_to_yaml

    c = load_config(overrides={"model_name": "deepseek3-tiny", "rope_type": "default"})
    saved = tmp_path / "config.yml"
    saved.write_text(config_to_yaml(c))
    assert load_config(saved) == c
    saved.write_text(config_to_yaml(c).replace("rope_factor: 4.0", "rope_factor: 8.0"))
    with pytest.raises(ConfigError, match="rope_factor=8.0 applies only with rope_type=yarn"):
        load_config(saved)
