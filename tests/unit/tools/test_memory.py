"""`expertax memory`: residual bytes, state bytes, XLA figures, the HBM verdict, the CLI."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax import cli
from expertax.config import load_config
from expertax.models import decoder
from expertax.nn import param
from expertax.parallel import remat
from expertax.tools.memory import memory_report
from expertax.train.trainer import build_trainer

SMALL = [
    "model_name=deepseek3-tiny",
    "base_num_decoder_layers=3",
    "max_target_length=32",
    "per_device_batch_size=1",
]


@pytest.fixture(scope="module")
def report():
    c = load_config(
        overrides=[*SMALL, "remat_policy=custom", "moe_mlpwo=offload", "query_wa_proj=device"]
    )
    return c, memory_report(c, hbm_gib=1.0)


def test_residual_bytes_are_shape_times_dtype_size(report):
    c, r = report
    assert r["residuals"]
    for res in r["residuals"]:
        assert res["bytes"] == math.prod(res["shape"]) * jnp.dtype(res["dtype"]).itemsize
        assert res["total_bytes"] == res["bytes"] * res["layers"]
    device = sum(x["total_bytes"] for x in r["residuals"] if x["placement"] == "device")
    host = sum(x["total_bytes"] for x in r["residuals"] if x["placement"] == "host")
    assert (r["residual_bytes_device"], r["residual_bytes_host"]) == (device, host)
    got = {(x["stack"], x["name"], x["placement"], tuple(x["shape"])) for x in r["residuals"]}
    b, t, d = r["batch_per_device"], c.max_target_length, c.base_emb_dim
    rows = b * t * c.num_experts_per_tok
    assert got == {
        ("dense", remat.DECODER_LAYER_INPUT, "device", (b, t, d)),
        ("dense", remat.QUERY_WA_PROJ, "device", (b, t, c.q_lora_rank)),
        ("moe", remat.DECODER_LAYER_INPUT, "device", (b, t, d)),
        ("moe", remat.QUERY_WA_PROJ, "device", (b, t, c.q_lora_rank)),
        ("moe", remat.MOE_MLPWO, "host", (rows, d)),
    }
    layers = {x["stack"]: x["layers"] for x in r["residuals"]}
    assert layers == {"dense": c.num_dense_layers, "moe": c.num_moe_layers}


def test_state_bytes_per_device(report):
    c, r = report
    assert r["devices"] == 8 and r["mesh"]["fsdp"] == 8
    total = param.count(decoder.spec(c)) * 4
    assert total / 8 <= r["parameter_bytes"] < total  # sharded, with small replicated leaves
    assert r["gradient_bytes"] == r["parameter_bytes"]
    # AdamW's mu and nu for every trainable leaf (the routing bias is frozen: no moments).
    bias = c.num_moe_layers * c.num_experts * 4
    assert r["optimizer_state_bytes"] >= 2 * (r["parameter_bytes"] - bias)
    assert r["optimizer_state_bytes"] <= 2 * r["parameter_bytes"] + 64


def test_xla_figures_and_verdict(report):
    _, r = report
    x = r["xla"]
    assert x["argument"] > 0 and x["temp"] > 0
    assert r["peak_device_bytes"] == x["argument"] + x["output"] - x["alias"] + x["temp"]
    assert r["fits"] is (r["peak_device_bytes"] <= 2**30)


def test_cli_writes_json_and_says_whether_it_fits(tmp_path, capsys):
    path = tmp_path / "m.json"
    rc = cli.main(
        [
            "memory",
            "model_name=llama-tiny",
            "base_num_decoder_layers=1",
            "max_target_length=16",
            "remat_policy=save_out_proj",
            "--json",
            str(path),
            "--hbm",
            "0.001",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "DOES NOT FIT" in out and "out_proj" in out
    data = json.loads(path.read_text())
    assert data["fits"] is False and data["hbm_gib"] == 0.001
    for res in data["residuals"]:
        assert set(res) >= {"name", "shape", "bytes", "placement"}
        assert isinstance(res["name"], str) and res["placement"] in ("device", "host")
        assert all(isinstance(s, int) for s in res["shape"])
    assert {r["name"] for r in data["residuals"]} == {remat.DECODER_LAYER_INPUT, remat.OUT_PROJ}


def test_offload_the_backend_cannot_honour_is_an_error(monkeypatch, capsys):
    monkeypatch.setattr(remat, "backend_has_pinned_host", lambda devices=None: False)
    rc = cli.main(["memory", "model_name=llama-tiny", "remat_policy=custom", "mlpwo=offload"])
    assert rc == 2 and "mlpwo=offload" in capsys.readouterr().err
    rc = cli.main(["memory", "model_name=llama-tiny", "optimizer_memory_host_offload=true"])
    assert rc == 2 and "optimizer_memory_host_offload=true" in capsys.readouterr().err


def test_host_offloaded_state_lives_in_pinned_host_and_trains_the_same():
    base = [
        "model_name=llama-tiny",
        "base_num_decoder_layers=1",
        "max_target_length=16",
        "per_device_batch_size=1",
    ]
    from expertax.train.inputs import make_data

    finals = []
    for extra in ([], ["optimizer_memory_host_offload=true", "parameter_memory_host_offload=true"]):
        c = load_config(overrides=[*base, *extra])
        tr = build_trainer(c, jax.devices()[:1])
        step = tr.compile()
        state = tr.init_state()
        data = make_data(c, tr)
        with tr.context():
            for _ in range(2):
                state, _ = step(state, tr.put_batch(next(data)))
        kinds = {
            x.sharding.memory_kind
            for x in jax.tree.leaves((state.params, state.opt_state))
            if hasattr(x, "sharding") and x.ndim
        }
        assert kinds == ({"pinned_host"} if extra else {"device"})
        finals.append([np.asarray(x) for x in jax.tree.leaves(state.params)])
    for a, b in zip(*finals, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_temp_bytes_fall_from_none_to_minimal_to_full():
    """On one device, with layers and a length where the saved residuals outweigh the
    temporaries of one layer's recomputation (with 3 layers of 128 tokens they do not: XLA:CPU's
    dense expansion of the grouped matmul dominates the peak)."""
    temps = {}
    for policy in ("none", "minimal", "full"):
        c = load_config(
            overrides=[
                "model_name=deepseek3-tiny",
                f"remat_policy={policy}",
                "base_num_decoder_layers=8",
                "max_target_length=1024",
                "per_device_batch_size=1",
            ]
        )
        tr = build_trainer(c, jax.devices()[:1])
        temps[policy] = tr.compile().memory_analysis().temp_size_in_bytes
    assert temps["none"] > temps["minimal"] > temps["full"], temps


@pytest.mark.slow
def test_devices_flag_reexecutes_with_simulated_devices(capfd):
    with pytest.raises(SystemExit) as done:
        cli.main(
            [
                "memory",
                "model_name=llama-tiny",
                "base_num_decoder_layers=1",
                "max_target_length=16",
                "--devices",
                "2",
            ]
        )
    assert done.value.code == 0
    assert "on 2 cpu devices" in capfd.readouterr().out
