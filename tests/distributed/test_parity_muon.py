"""Muon (`opt_type=muon`) trains every layout the same as one device: `expertax parity` rows of
deepseek3-tiny with MuonClip (EP x FSDP, EP x TP x data, FSDP x TP) and mixtral-tiny (a 2-stage
pipeline with EP x FSDP inside, the ring of experts with the expert axis as tensor parallelism).
Each layout orthogonalises its matrices in its own layout (train/muon_layout.py: all-to-alls,
slices and gathers in a shard_map) and measures its heads' largest logits on its own shards, so
a wrong step in either moves the losses. A file of its own so that pytest-xdist runs it beside
the other parity tests."""

from __future__ import annotations

import jax
import pytest

from expertax.preflight import load_config
from expertax.tools.parity.layouts import layout_config, parse_layout
from expertax.tools.parity.run import parity_table
from expertax.train import muon
from expertax.train.trainer import build_trainer
from tests.distributed.test_parity import SMALL, _check_rows

pytestmark = pytest.mark.distributed

# deepseek3-tiny with MuonClip (QK-clip at a threshold its heads pass every step: the clip
# runs on the maxima each layout measures), and in a pipeline without it (refused there);
# mixtral-tiny (GQA: no QK-clip) in the four kinds of layout
CASES = [
    (
        "deepseek3-tiny",
        ["use_qk_clip=true", "qk_clip_threshold=3"],
        ["sparse-padded-ep4-fsdp2", "sparse-padded-ep2-tp2-data2", "dense-fsdp4-tp2"],
    ),
    ("deepseek3-tiny", [], ["sparse-ring-pp2-ep2-fsdp2"]),  # Muon alone in a pipeline
    (
        "mixtral-tiny",
        [],
        [
            "sparse-ring-pp2-ep2-fsdp2",
            "sparse-ring-ep2-fsdp2-tp2-eptp",
            "sparse-padded-ep4-fsdp2",
            "dense-fsdp4-tp2",
        ],
    ),
]


@pytest.mark.extended  # three parity tables of 1-4 layouts (40-150 s each): CI's second run
@pytest.mark.parametrize(
    ("model", "extra", "layouts"),
    CASES,
    ids=["deepseek3-tiny-clip", "deepseek3-tiny-pp", "mixtral-tiny"],
)
def test_muon_trains_every_layout_as_one_device(model, extra, layouts):
    """3 steps of each layout give the one-device run's losses within the float32 tolerance,
    and the optimizer state really is Muon's (a MuonState per partition of the matrices)."""
    c = load_config(overrides=[f"model_name={model}", "opt_type=muon", *extra, *SMALL])
    parsed = [parse_layout(n) for n in layouts]
    trainer = build_trainer(layout_config(c, parsed[0], 8))
    is_muon = lambda x: isinstance(x, muon.MuonState)
    nodes = jax.tree.leaves(trainer.state_shardings.opt_state, is_leaf=is_muon)
    assert any(is_muon(n) for n in nodes)
    result = parity_table(c, steps=3, layout_list=parsed, echo=lambda *_: None)
    assert result["refused"] == []
    scale = max(abs(x) for x in result["reference_losses"])
    for r in result["rows"]:
        print(
            f"\n{model} pp{r['pp']} ep{r['ep']} fsdp{r['fsdp']} tp{r['tp']}: "
            f"|dloss| {r['max_abs_loss_diff']:.3g}"
        )
    _check_rows(result["rows"], result["tolerance"], scale, len(layouts))
    assert result["ok"]
