"""Every sharding-rules preset in configs/parallel/ trains the same model: deepseek3-tiny (16
experts, MLA, a dense layer and MoE layers) on an expert 2 x fsdp 4 mesh under the preset, its
loss and gradients against the one-device model's. `exp-fsdp` runs by default; `default` and
`ep-tp` are covered by the parity matrix as well and run on demand (-m full_grid)."""

from __future__ import annotations

import pytest

from expertax import init_params
from expertax.config import configs_dir, load_config
from tests.sharded import assert_model_on_mesh_matches_one_device, two_document_batch

PRESETS = sorted(p.stem for p in (configs_dir() / "parallel").glob("*.yml"))


def test_the_presets_are_the_files():
    assert {"default", "ep-tp", "exp-fsdp"} <= set(PRESETS)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "preset",
    [p if p == "exp-fsdp" else pytest.param(p, marks=pytest.mark.full_grid) for p in PRESETS],
)
def test_preset_trains_the_one_device_model(preset):
    small = {"model_name": "deepseek3-tiny", "max_target_length": 32, "per_device_batch_size": 1}
    mesh = {"ici_expert_parallelism": 2, "ici_fsdp_parallelism": 4}
    c = load_config(overrides={**small, **mesh, "sharding_rules": preset})
    one = load_config(overrides={**small, "ici_fsdp_parallelism": 1})
    batch = two_document_batch(c.vocab_size, 8, 32, 11)
    assert_model_on_mesh_matches_one_device(c, one, init_params(one), batch)
