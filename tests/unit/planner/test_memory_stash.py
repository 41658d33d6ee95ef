"""`expertax memory` with `moe_paged_stash`: the stash bytes, and the MoE residuals it replaces."""

from __future__ import annotations

import pytest

from expertax.nn.moe import exchange
from expertax.parallel import remat
from expertax.planner.format import format_report
from expertax.planner.plan import memory_report
from expertax.planner.residuals import layer_residuals
from expertax.planner.stash import STASH_PREFIX, worst_case_stash_rows
from expertax.preflight import load_config
from expertax.train.trainer import build_trainer

# deepseek3-tiny with 8 MoE layers (1 dense + 8), EP=4 x FSDP=2 on the 8 simulated devices,
# batch 1 per device x 32 tokens, D=128, K=4, 16 experts (4 per device), float32.
STASHED = [
    "model_name=deepseek3-tiny",
    "base_num_decoder_layers=9",
    "max_target_length=32",
    "per_device_batch_size=1",
    "ici_expert_parallelism=4",
    "ici_fsdp_parallelism=2",
    "a2a_impl=padded",
    "remat_policy=custom",
    "moe_mlpwo=device",
    "query_wa_proj=device",
    "moe_paged_stash=true",
]


@pytest.fixture(scope="module")
def stashed():
    c = load_config(overrides=STASHED)
    return c, memory_report(c, top=0)


def test_stash_bytes_by_hand(stashed):
    c, r = stashed
    s = r["stash"]
    assert c.num_moe_layers == 8 and s["names"] == [remat.MOE_MLPWO]
    itemsize, d, layers = 4, 128, 8
    expected = 32 * 4  # a device's tokens x K: the rows it receives on average
    capacity = -(-11 * layers * expected // 10)  # ceil(1.1 x 8 x 128) = 1127
    assert (s["expected_rows_per_layer"], s["capacity_rows"], s["page_rows"]) == (128, 1127, 256)
    assert s["buffer_bytes"] == (capacity + 256) * d * itemsize
    assert s["routed_bytes"] == layers * expected * d * itemsize
    # Without the stash each layer saves the whole all-to-all receive buffer: EP x N x min(K, X).
    worst_rows = exchange.buffer_rows(c, 0, 32, 4)
    assert worst_rows == 4 * 32 * 4
    assert s["worst_case_bytes"] == layers * worst_rows * d * itemsize


def test_stash_within_target_and_smaller_than_worst_case(stashed):
    _, r = stashed
    s = r["stash"]
    page_bytes = s["page_rows"] * sum(s["widths"].values()) * 4
    assert s["buffer_bytes"] <= 1.15 * s["routed_bytes"] + page_bytes
    assert s["worst_case_bytes"] > s["buffer_bytes"]
    assert s["routed_bytes"] < s["buffer_bytes"]  # the capacity factor and the page of slack


def test_moe_stack_keeps_its_inputs_and_the_stash_only(stashed):
    c, r = stashed
    moe = {x["name"]: x for x in r["residuals"] if x["stack"] == "moe"}
    assert set(moe) == {remat.DECODER_LAYER_INPUT, STASH_PREFIX + remat.MOE_MLPWO}
    assert moe[remat.DECODER_LAYER_INPUT]["layers"] == 8
    buf = moe[STASH_PREFIX + remat.MOE_MLPWO]
    assert (buf["layers"], buf["shape"]) == (1, [1127 + 256, 128])
    assert buf["total_bytes"] == r["stash"]["buffer_bytes"]
    # the dense stack is unchanged: it still saves query_wa_proj
    dense = {x["name"] for x in r["residuals"] if x["stack"] == "dense"}
    assert dense == {remat.DECODER_LAYER_INPUT, remat.QUERY_WA_PROJ}
    assert r["residual_bytes_device"] == sum(x["total_bytes"] for x in r["residuals"])
    # negative control: without the stash the MoE layer saves the stashed and the other names
    plain = c.model_copy(update={"moe_paged_stash": False})
    names = {x.name for x in layer_residuals(plain, moe=True, batch_local=1)}
    assert {remat.MOE_MLPWO, remat.QUERY_WA_PROJ} <= names


def test_text_report_has_the_stash_line(stashed):
    _, r = stashed
    text = format_report(r)
    line = next(x for x in text.splitlines() if x.startswith("paged stash"))
    assert "buffer 691.50 KiB" in line and "worst case without the stash 2.00 MiB" in line
    assert "buffer / routed 1.35" in line and "worst case / buffer 2.96" in line
    assert r["peak_device_bytes"] > 0


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_the_worst_case_counts_the_stashed_names_of_the_same_path(stashed, fused):
    """Like with like: without the stash the same path (fused or separate) tags the stashed
    names (the fused routed FFN keeps its [M, D] expert outputs when moe_mlpwo is kept), so
    the worst case counts each of them, at the all-to-all receive buffer's rows."""
    c, _ = stashed
    c = c.model_copy(update={"moe_fused_routed_ffn": fused})
    trainer = build_trainer(c)
    worst = worst_case_stash_rows(c, trainer)
    assert set(worst) == set(remat.stashed_names(c)) == {remat.MOE_MLPWO}
    assert worst[remat.MOE_MLPWO] == exchange.buffer_rows(c, 0, 32, 4) * c.base_emb_dim
