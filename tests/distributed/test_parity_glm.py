"""`expertax parity` rows of glm4.5-tiny: GQA with q/k/v biases, the per-head q/k norm and RoPE
over half of each head (head dim 40, not 96 / 4), a dense layer, then sigmoid routing with a
selection-only bias over 4 groups of 4 experts and a shared expert. On demand (-m full_grid):
one row costs 52 s on 2 cores, more than the default run's margin; qwen3-moe-tiny's default
row already covers the all-to-all exchange with the q/k norm's heads split over `tensor`."""

from __future__ import annotations

import pytest

from expertax.preflight import load_config
from tests.distributed.test_parity import SMALL, layouts_with_control, one_row, with_moe_attn

pytestmark = [pytest.mark.distributed, pytest.mark.full_grid]

MODEL = ["model_name=glm4.5-tiny", *SMALL]


# the pieces on the same layout in the default run: q/k norm with heads over `tensor` (qwen3's
# row), q/k/v biases over `tensor` (gpt-oss's row), GLM's one-device numerics against HF
@pytest.mark.covered_by(
    "tests/distributed/test_parity_qwen3.py::test_parity_qwen3_moe_tiny_row",
    "tests/distributed/test_parity_gpt_oss.py::test_parity_gpt_oss_tiny_row",
    "tests/parity/test_hf_glm.py::test_logits_match_transformers[glm]",
    "tests/unit/nn/test_rope.py::test_partial_rotation_by_hand",
)
def test_parity_glm45_tiny_row(tmp_path):
    """3 steps of EP=2 x TP=2 x data=2 (padded all-to-all) equal the one-device run's losses."""
    c = load_config(overrides=MODEL)
    assert c.attention_qkv_bias and c.attention_qk_norm and c.partial_rotary_factor == 0.5
    row = one_row(MODEL, "sparse-padded-ep2-tp2-data2", tmp_path)
    assert (row["ep"], row["tp"], row["data"]) == (2, 2, 2)


def _larger_key_bias(state, trainer):
    """Test hook: the key bias of every MoE layer shifted by 2 (the negative control)."""
    return with_moe_attn(state, "bk", lambda b: b + 2.0)


# the layout at layer level and a table-level control in the default run
@pytest.mark.covered_by(
    "tests/distributed/test_ep.py::test_layer_forward_gradients_and_stats_match_no_mesh"
    "[a2a-ep4-fsdp2-expfsdp]",
    "tests/distributed/test_parity.py::test_parity_pipeline_with_negative_control",
)
def test_parity_glm45_tiny_ep_fsdp_with_control():
    """EP=4 x FSDP=2 equals the one-device run; EP=8 with a shifted key bias does not."""
    c = load_config(overrides=MODEL)
    layouts_with_control(c, ["sparse-padded-ep4-fsdp2"], "sparse-padded-ep8", _larger_key_bias)
