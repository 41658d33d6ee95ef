"""Every sharding-rules preset in configs/parallel/ trains the same model: deepseek3-tiny (16
experts, MLA, a dense layer and MoE layers) on an expert 2 x fsdp 4 mesh under the preset, its
loss and gradients against the one-device model's. `exp-fsdp` runs by default; `default` and
`ep-tp` run on demand (-m full_grid): the same check under `exp-fsdp`, and the layer tests
(outputs and gradients against no mesh) and parity rows under each, cover them."""

from __future__ import annotations

import pytest

from expertax import init_params
from expertax.config import configs_dir
from expertax.preflight import load_config
from tests.sharded import assert_model_on_mesh_matches_one_device, two_document_batch

PRESETS = sorted(p.stem for p in (configs_dir() / "parallel").glob("*.yml"))


def test_the_presets_are_the_files():
    assert {"default", "ep-tp", "exp-fsdp"} <= set(PRESETS)


_HERE = "tests/distributed/test_rules_presets.py::test_preset_trains_the_one_device_model"
_LAYER = "tests/distributed/test_ep.py::test_layer_forward_gradients_and_stats_match_no_mesh"
# what covers each preset's case on demand, beside the `exp-fsdp` case (covered_by)
_COVERED_BY = {
    "default": (f"{_LAYER}[a2a-ep8]", f"{_LAYER}[a2a-ep4-fsdp2-expfsdp]"),
    "ep-tp": (
        f"{_LAYER}[a2a-eptp-ep4-data2]",
        f"{_LAYER}[ring-eptp-ep4-data2]",
        "tests/distributed/test_parity_matrix.py::test_parity_matrix_sample",
    ),
}


def _preset(p):
    if p == "exp-fsdp":
        return p
    cover = pytest.mark.covered_by(f"{_HERE}[exp-fsdp]", *_COVERED_BY.get(p, ()))
    return pytest.param(p, marks=[pytest.mark.full_grid, cover])


@pytest.mark.distributed
@pytest.mark.parametrize("preset", [_preset(p) for p in PRESETS])
def test_preset_trains_the_one_device_model(preset):
    small = {"model_name": "deepseek3-tiny", "max_target_length": 32, "per_device_batch_size": 1}
    mesh = {"ici_expert_parallelism": 2, "ici_fsdp_parallelism": 4}
    c = load_config(overrides={**small, **mesh, "sharding_rules": preset})
    one = load_config(overrides={**small, "ici_fsdp_parallelism": 1})
    batch = two_document_batch(c.vocab_size, 8, 32, 11)
    assert_model_on_mesh_matches_one_device(c, one, init_params(one), batch)
