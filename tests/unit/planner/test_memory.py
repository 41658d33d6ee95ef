"""`expertax memory`: residual bytes, state bytes, XLA figures, the HBM verdict, the CLI."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.tolerances import tol

from expertax import cli
from expertax.parallel import remat
from expertax.planner.plan import memory_report
from expertax.preflight import load_config
from expertax.train.trainer import build_trainer

SMALL = [
    "model_name=deepseek3-tiny",
    "base_num_decoder_layers=3",
    "max_target_length=32",
    "per_device_batch_size=1",
]


@pytest.fixture(scope="module")
def report():
    # the separate sparse path (the fused routed FFN keeps moe_mlpwo too:
    # tests/unit/parallel/test_names_kept.py)
    overrides = ["remat_policy=custom", "moe_mlpwo=offload", "query_wa_proj=device"]
    c = load_config(overrides=[*SMALL, *overrides, "moe_fused_routed_ffn=false"])
    return c, memory_report(c, hbm_gib=1.0)


@pytest.fixture(scope="module")
def measured(report):
    """Bytes of the really initialized state on the first device (not from the report's code)."""
    c, _ = report
    state = build_trainer(c).init_state()
    d0 = jax.devices()[0]

    def on_d0(tree):
        leaves = jax.tree.leaves(tree)
        return sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == d0)

    return {"params": on_d0(state.params), "opt": on_d0(state.opt_state), "state": on_d0(state)}


# deepseek3-tiny, 3 layers (1 dense, 2 MoE), D=128, q_lora_rank=64, K=4, float32, batch 1 per
# device x 32 tokens; bytes by hand: [1, 32, 128] x 4 = 16384, [1, 32, 64] x 4 = 8192, the MoE
# output [1 x 32 x 4 rows, 128] x 4 = 65536.
EXPECTED_RESIDUALS = {
    # (stack, name, placement, shape, bytes, layers, total_bytes)
    ("dense", remat.DECODER_LAYER_INPUT, "device", (1, 32, 128), 16384, 1, 16384),
    ("dense", remat.QUERY_WA_PROJ, "device", (1, 32, 64), 8192, 1, 8192),
    ("moe", remat.DECODER_LAYER_INPUT, "device", (1, 32, 128), 16384, 2, 32768),
    ("moe", remat.QUERY_WA_PROJ, "device", (1, 32, 64), 8192, 2, 16384),
    ("moe", remat.MOE_MLPWO, "host", (128, 128), 65536, 2, 131072),
}


def test_residuals_by_name_shape_and_bytes(report):
    _, r = report
    got = {
        (x["stack"], x["name"], x["placement"], tuple(x["shape"]), x["bytes"], x["layers"])
        + (x["total_bytes"],)
        for x in r["residuals"]
    }
    assert got == EXPECTED_RESIDUALS
    assert len(r["residuals"]) == len(EXPECTED_RESIDUALS)  # no duplicates
    assert {x["dtype"] for x in r["residuals"]} == {"float32"}
    assert (r["residual_bytes_device"], r["residual_bytes_host"]) == (73728, 131072)
    assert r["stash"] is None  # moe_paged_stash off (tests/unit/planner/test_memory_stash.py)


def test_state_bytes_are_the_initialized_state(report, measured):
    _, r = report
    assert r["devices"] == 8 and r["mesh"]["fsdp"] == 8
    assert r["parameter_bytes"] == measured["params"]
    assert r["optimizer_state_bytes"] == measured["opt"]
    assert r["gradient_bytes"] == measured["params"]  # grad_dtype = weight_dtype = float32


def test_xla_figures_and_verdict(report, measured):
    _, r = report
    x = r["xla"]
    # XLA's own figures against the initialized state: the donated state is aliased in full,
    # and the arguments are the state plus the batch (5 arrays of [1, 32] x 4 bytes per device).
    assert x["alias"] == measured["state"]
    assert x["argument"] == measured["state"] + 5 * 32 * 4
    assert 0 < x["output"] - x["alias"] < 4096  # only the metrics are new outputs
    assert x["temp"] > r["residual_bytes_device"] + r["residual_bytes_host"]  # XLA:CPU: one memory
    # The peak counts the donated state once (a peak counting arguments and outputs apart would
    # count it twice), plus the temporaries.
    # XLA:CPU's one memory counts the offloaded moe_mlpwo residuals in the temporaries; the
    # estimate takes them out.
    assert r["offloaded_residual_bytes"] == r["residual_bytes_host"] == 131072
    peak_one_memory = r["peak_device_bytes"] + r["offloaded_residual_bytes"]
    assert 0 <= peak_one_memory - x["temp"] - x["argument"] < 4096
    assert r["fits"] is True and r["peak_device_bytes"] < 64 * 2**20  # ~12 MiB of 1 GiB


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
    rc = cli.main(["memory", "model_name=llama-tiny", "remat_policy=custom", "mlpwi_0=offload"])
    assert rc == 2 and "mlpwi_0=offload" in capsys.readouterr().err
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
    # Bitwise equal at XLA:CPU's default backend optimisation; at the tests' level 0
    # (conftest.py) the two programs' updates round 3 of 65536 elements 1 ulp apart.
    for a, b in zip(*finals, strict=True):
        np.testing.assert_allclose(a, b, **tol())


@pytest.mark.extended  # 50-70 s: the only check of the compiled memory under the presets
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


def test_residual_sources_reads_names_origins_and_host_placement():
    """The structured residual list: a remat-saved name, an offloaded tensor, an unnamed one."""
    from jax.ad_checkpoint import checkpoint_name

    from expertax.planner.residuals import residual_sources

    def f(x):
        a = checkpoint_name(jnp.sin(x) * 2.0, "kept")
        b = checkpoint_name(jnp.cos(a) * 3.0, "moved")
        return jnp.sum(jnp.tanh(b))

    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    save = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["kept"],
        names_which_can_be_offloaded=["moved"],
        offload_src="device",
        offload_dst="pinned_host",
    )
    got = {
        (s.kind, s.name, s.aval.shape, s.host)
        for s in residual_sources(jax.checkpoint(f, policy=save), x)
    }
    assert ("named", "kept", (4, 8), False) in got
    assert ("unnamed", "device_put", (4, 8), True) in got  # the offload of "moved"
    assert all(not s.host for s in residual_sources(f, x))  # negative control: no policy
    # Without remat autodiff keeps what the derivatives use (cos x for sin, sin a for cos, ...),
    # none of them a named value itself.
    plain = {(s.kind, s.name) for s in residual_sources(f, x)}
    assert ("unnamed", "cos") in plain and {k for k, _ in plain} == {"unnamed"}
    assert len(residual_sources(f, x)) > len(residual_sources(jax.checkpoint(f, policy=save), x))
