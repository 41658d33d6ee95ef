"""`expertax parity` rows of qwen3-moe-tiny: GQA with the per-head q/k RMSNorm, a head dim of its
own (48, not 128 / 4 heads), softmax top-4 of 16 experts with normalized weights. The default
run trains one layout against one device (the all-to-all exchange with expert x tensor x data:
the heads, and so the normed queries and keys, split over `tensor`; 31 s on 2 cores). Two more
layouts and one whose query norm is perturbed, which must fail the table, run on demand
(-m full_grid: 90-130 s, more than CI's margin holds beside the extended run; the default row,
the extended matrix sample's ep-tp ring, the layer tests and a table control cover them). A file
of its own so that pytest-xdist runs it beside the other parity tests."""

from __future__ import annotations

import pytest

from expertax.preflight import load_config
from tests.distributed.test_parity import SMALL, layouts_with_control, one_row, with_moe_attn

pytestmark = pytest.mark.distributed

MODEL = ["model_name=qwen3-moe-tiny", *SMALL]


@pytest.mark.extended  # a parity table in a CLI child (20-70 s): CI's second run
def test_parity_qwen3_moe_tiny_row(tmp_path):
    """3 steps of EP=2 x TP=2 x data=2 (padded all-to-all) equal the one-device run's losses."""
    assert load_config(overrides=MODEL).attention_qk_norm
    row = one_row(MODEL, "sparse-padded-ep2-tp2-data2", tmp_path)
    assert (row["ep"], row["tp"], row["data"], row["routing_flips"]) == (2, 2, 2, [0, 0])


def _larger_query_norm(state, trainer):
    """Test hook: the query norm's scale doubled in every layer (sharper attention: at the
    random init the scores are small, and a few percent on one channel moves the loss by less
    than 100 x the tolerance)."""
    return with_moe_attn(state, "q_norm", lambda q: 2.0 * q)


@pytest.mark.full_grid
@pytest.mark.covered_by(
    "tests/distributed/test_parity_qwen3.py::test_parity_qwen3_moe_tiny_row",
    "tests/distributed/test_parity_matrix.py::test_parity_matrix_sample",
    "tests/distributed/test_ep.py::test_layer_forward_gradients_and_stats_match_no_mesh"
    "[a2a-ep4-fsdp2-expfsdp]",
    "tests/distributed/test_parity.py::test_parity_pipeline_with_negative_control",
)
def test_parity_qwen3_moe_tiny_more_layouts_with_control():
    """EP=4 x FSDP=2 and the ring of experts with the expert axis as tensor parallelism (ep-tp)
    equal the one-device run; EP=8 with a perturbed query norm does not (negative control)."""
    c = load_config(overrides=MODEL)
    good = ["sparse-padded-ep4-fsdp2", "sparse-ring-ep2-fsdp2-tp2-eptp"]
    layouts_with_control(c, good, "sparse-padded-ep8", _larger_query_norm)
