"""`expertax parity` rows of qwen3-moe-tiny: GQA with the per-head q/k RMSNorm, a head dim of its
own (48, not 128 / 4 heads), softmax top-4 of 16 experts with normalized weights. The default
run trains one layout against one device (the all-to-all exchange with expert x tensor x data:
the heads, and so the normed queries and keys, split over `tensor`; 31 s on 2 cores). Two more
layouts and one whose query norm is perturbed, which must fail the table, run on demand
(-m full_grid: 90-130 s, more than CI's margin holds beside the extended run). A file of its
own so that pytest-xdist runs it beside the other parity tests."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from expertax.config import load_config
from expertax.tools import parity
from tests.distributed.test_parity import SMALL, _check_rows, parity_child

pytestmark = pytest.mark.distributed

MODEL = ["model_name=qwen3-moe-tiny", *SMALL]


def test_parity_qwen3_moe_tiny_row(tmp_path):
    """3 steps of EP=2 x TP=2 x data=2 (padded all-to-all) equal the one-device run's losses."""
    assert load_config(overrides=MODEL).attention_qk_norm
    path = tmp_path / "parity.json"
    run = parity_child([*MODEL, "--steps", "3", "--layouts", "sparse-padded-ep2-tp2-data2"], path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Involuntary full rematerialization" not in run.stdout + run.stderr
    report = json.loads(path.read_text())
    assert report["ok"] and report["refused"] == []
    _check_rows(report["rows"], report["tolerance"], 10.0, 1)  # losses below 10 (vocab 512)
    row = report["rows"][0]
    print(f"\nqwen3-moe-tiny ep2-tp2-data2: max |dloss| {row['max_abs_loss_diff']:.3g}")
    assert (row["ep"], row["tp"], row["data"], row["routing_flips"]) == (2, 2, 2, [0, 0])


def _larger_query_norm(state, trainer):
    """Test hook: the query norm's scale doubled in every layer (sharper attention: at the
    random init the scores are small, and a few percent on one channel moves the loss by less
    than 100 x the tolerance)."""
    layers = state.params.moe_layers
    q_norm = layers.attn.q_norm
    q_norm = jax.device_put(2.0 * q_norm, q_norm.sharding)
    attn = dataclasses.replace(layers.attn, q_norm=q_norm)
    params = dataclasses.replace(state.params, moe_layers=dataclasses.replace(layers, attn=attn))
    return dataclasses.replace(state, params=params)


@pytest.mark.full_grid
def test_parity_qwen3_moe_tiny_more_layouts_with_control():
    """EP=4 x FSDP=2 and the ring of experts with the expert axis as tensor parallelism (ep-tp)
    equal the one-device run; EP=8 with a perturbed query norm does not (negative control)."""
    c = load_config(overrides=MODEL)
    good = [
        parity.parse_layout(n)
        for n in ("sparse-padded-ep4-fsdp2", "sparse-ring-ep2-fsdp2-tp2-eptp")
    ]
    bad = parity.parse_layout("sparse-padded-ep8")
    result = parity.parity_table(
        c,
        steps=3,
        layout_list=[*good, bad],
        corrupt={bad: _larger_query_norm},
        echo=lambda *_: None,
    )
    scale = max(abs(x) for x in result["reference_losses"])
    for r in result["rows"]:
        print(f"\nep{r['ep']} fsdp{r['fsdp']} tp{r['tp']}: |dloss| {r['max_abs_loss_diff']:.3g}")
    _check_rows(result["rows"][:2], result["tolerance"], scale, 2)
    assert result["rows"][2]["max_abs_loss_diff"] > 100 * result["tolerance"] * scale
    assert not result["ok"]
