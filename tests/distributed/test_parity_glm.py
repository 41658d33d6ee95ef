"""`expertax parity` rows of glm4.5-tiny: GQA with q/k/v biases, the per-head q/k norm and RoPE
over half of each head (head dim 40, not 96 / 4), a dense layer, then sigmoid routing with a
selection-only bias over 4 groups of 4 experts and a shared expert. On demand (-m full_grid):
one row costs 52 s on 2 cores, more than the default run's margin; qwen3-moe-tiny's default
row already covers the all-to-all exchange with the q/k norm's heads split over `tensor`."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from expertax.config import load_config
from expertax.tools import parity
from tests.distributed.test_parity import SMALL, _check_rows, parity_child

pytestmark = [pytest.mark.distributed, pytest.mark.full_grid]

MODEL = ["model_name=glm4.5-tiny", *SMALL]


def test_parity_glm45_tiny_row(tmp_path):
    """3 steps of EP=2 x TP=2 x data=2 (padded all-to-all) equal the one-device run's losses."""
    c = load_config(overrides=MODEL)
    assert c.attention_qkv_bias and c.attention_qk_norm and c.partial_rotary_factor == 0.5
    path = tmp_path / "parity.json"
    run = parity_child([*MODEL, "--steps", "3", "--layouts", "sparse-padded-ep2-tp2-data2"], path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(path.read_text())
    assert report["ok"] and report["refused"] == []
    _check_rows(report["rows"], report["tolerance"], 10.0, 1)  # losses below 10 (vocab 512)
    row = report["rows"][0]
    print(f"\nglm4.5-tiny ep2-tp2-data2: max |dloss| {row['max_abs_loss_diff']:.3g}")
    assert (row["ep"], row["tp"], row["data"]) == (2, 2, 2)


def _larger_key_bias(state, trainer):
    """Test hook: the key bias of every MoE layer shifted by 2 (the negative control)."""
    layers = state.params.moe_layers
    bk = layers.attn.bk
    bk = jax.device_put(bk + 2.0, bk.sharding)
    attn = dataclasses.replace(layers.attn, bk=bk)
    params = dataclasses.replace(state.params, moe_layers=dataclasses.replace(layers, attn=attn))
    return dataclasses.replace(state, params=params)


def test_parity_glm45_tiny_ep_fsdp_with_control():
    """EP=4 x FSDP=2 equals the one-device run; EP=8 with a shifted key bias does not."""
    c = load_config(overrides=MODEL)
    good = parity.parse_layout("sparse-padded-ep4-fsdp2")
    bad = parity.parse_layout("sparse-padded-ep8")
    result = parity.parity_table(
        c, steps=3, layout_list=[good, bad], corrupt={bad: _larger_key_bias}, echo=lambda *_: None
    )
    scale = max(abs(x) for x in result["reference_losses"])
    for r in result["rows"]:
        print(f"\nep{r['ep']} fsdp{r['fsdp']}: |dloss| {r['max_abs_loss_diff']:.3g}")
    _check_rows(result["rows"][:1], result["tolerance"], scale, 1)
    assert result["rows"][1]["max_abs_loss_diff"] > 100 * result["tolerance"] * scale
    assert not result["ok"]
