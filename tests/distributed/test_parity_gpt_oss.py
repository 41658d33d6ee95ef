"""`expertax parity` row of gpt-oss-tiny: GQA with q/k/v/o biases and sinks, sliding-window layers
alternating with full ones (the layer stack scanned one cycle at a time), YaRN without
truncation, a router with a trained bias, experts with biases and the clamped SwiGLU. The
default run trains one layout against one device (the all-to-all exchange with expert x tensor x
data: the heads split over `tensor`, the expert MLP dim too, so the down bias is counted on one
F shard; about 60 s of CPU on 2 cores, twice qwen3-moe-tiny's row: each scan step unrolls the
two-layer sliding/full cycle). A file of its own so that pytest-xdist runs it beside the other
parity tests."""

from __future__ import annotations

import pytest

from expertax.preflight import load_config
from tests.distributed.test_parity import SMALL, one_row

pytestmark = pytest.mark.distributed

MODEL = ["model_name=gpt-oss-tiny", *SMALL]


@pytest.mark.extended  # a parity table in a CLI child (20-70 s): CI's second run
def test_parity_gpt_oss_tiny_row(tmp_path):
    """3 steps of EP=2 x TP=2 x data=2 (padded all-to-all) equal the one-device run's losses."""
    c = load_config(overrides=MODEL)
    assert c.moe_expert_bias and c.attention_sinks and c.attention_layer_pattern == "sliding,full"
    row = one_row(MODEL, "sparse-padded-ep2-tp2-data2", tmp_path)
    assert (row["ep"], row["tp"], row["data"]) == (2, 2, 2)
