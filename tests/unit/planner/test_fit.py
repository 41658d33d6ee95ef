"""`expertax memory --fit`: input errors before compiling, the estimate's ranking, a budget some
candidates meet (the choice really compiles under it), a budget none meets (exit 1)."""

from __future__ import annotations

import json
import time

import pytest

from expertax import cli
from expertax.config import ConfigError
from expertax.models import decoder
from expertax.parallel import remat
from expertax.planner import estimate, fit, fit_table, space, steptime
from expertax.planner.plan import GIB, memory_report
from expertax.preflight import load_config
from expertax.train import muon

# One MoE layer of a shrunk Mixtral: compiles in seconds on 8 simulated CPU devices.
TINY = [
    "model_name=mixtral-tiny",
    "base_emb_dim=64",
    "base_moe_mlp_dim=64",
    "vocab_size=128",
    "base_num_decoder_layers=1",
    "num_experts=4",
    "max_target_length=32",
    "per_device_batch_size=1",
]


# Four layers and 2 x 128 tokens per device: activations outweigh the state, so remat and
# blockwise attention move the peak.
FIT = [*TINY[:4], "base_num_decoder_layers=4", "num_experts=4"]
FIT += ["max_target_length=128", "per_device_batch_size=2"]


@pytest.fixture(scope="module")
def cfg():
    return load_config(overrides=TINY)


def _never(*_):
    raise AssertionError("compiled although the input is refused")


@pytest.mark.parametrize(
    ("devices", "hbm", "headroom", "match"),
    [
        (8, 0.0, 10.0, "--hbm=0: the device memory budget must be positive"),
        (8, -1.0, 10.0, "must be positive"),
        (8, None, 10.0, "--fit needs --hbm"),
        (8, 1.0, 100.0, "--headroom=100"),
        # 3 divides neither num_experts=4, the heads (4) nor the width D=64.
        (3, 1.0, 10.0, "--devices=3: no split of 3 devices"),
        # 4096 devices: even with expert=4 and tensor=4, fsdp=256 does not divide D=64.
        (4096, 1.0, 10.0, "no split of 4096 devices"),
    ],
)
def test_bad_input_errors_before_compiling(cfg, devices, hbm, headroom, match):
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=match):
        fit.fit_search(cfg, devices, hbm, headroom=headroom, compile_fn=_never)
    assert time.perf_counter() - t0 < 5.0


def test_bad_input_exit_status_2(monkeypatch, capsys):
    monkeypatch.setattr(fit, "default_compile", _never)
    assert cli.main(["memory", *TINY, "--fit", "--hbm", "0"]) == 2
    assert "--hbm=0" in capsys.readouterr().err


def test_layouts_pass_mesh_checks_and_control(cfg):
    shapes = space.layouts(cfg, 8)
    splits = {(s["expert"], s["fsdp"], s["tensor"]) for s in shapes}
    assert splits == {(1, 8, 1), (2, 4, 1), (4, 2, 1), (1, 4, 2), (2, 2, 2), (4, 1, 2)}
    assert all(s["data"] == 1 and s["expert"] * s["fsdp"] * s["tensor"] == 8 for s in shapes)
    # Negative controls: 8 does not divide num_experts=4, tensor=4 not base_num_kv_heads=2.
    assert (8, 1, 1) not in splits and (2, 1, 4) not in splits
    assert space.layouts(cfg, 3) == []


def test_remat_presets_ordered_by_recompute(cfg):
    presets = space.remat_presets(cfg)
    shares = [space.recompute_share(cfg, p) for p in presets]
    assert presets[0] == "none" and presets[-1] == "full"
    assert shares == sorted(shares) and shares[0] == 0.0 and shares[-1] == 1.0


def test_estimate_ranks_bigger_candidates_above_smaller(cfg):
    est = estimate.Estimator(cfg)
    shape = {"pipeline": 1, "data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
    base = {"sharding_rules": "default", "remat_policy": "none", "num_vocab_tiling": 1}
    e = lambda **kw: est.estimate({**base, **kw}, shape)
    assert e() > e(remat_policy="minimal") > e(remat_policy="full")
    assert e() > e(mu_dtype="bfloat16", nu_dtype="bfloat16")
    assert e(remat_policy="full") > e(remat_policy="full", optimizer_memory_host_offload=True)
    # Negative control: a layout key the estimate ignores leaves it unchanged.
    assert e() == e(use_iota_embed=True)
    # Twice the batch per device: more activations.
    more = estimate.Estimator(cfg.model_copy(update={"per_device_batch_size": 2.0}))
    assert more.estimate(base, shape) > e()


# 80-145 s of compiles: CI's extended run (the default run keeps the refusal tests; the success
# path with a real compile and memory_report's cross-check runs only here)
@pytest.mark.extended
@pytest.mark.usefixtures("persistent_compile_cache")
def test_fit_picks_a_candidate_that_compiles_under_the_budget():
    cfg = load_config(overrides=FIT)
    # The search's first choice under a generous budget, then a budget 15% below its peak with
    # no headroom: the search must move on to blockwise attention, more recompute or another
    # layout.
    # Without host offload (which on XLA:CPU, one memory, moves nothing and costs nothing).
    first = fit.fit_search(cfg, 8, 1.0, headroom=0.0, max_compiles=1, offload=False)["best"]
    assert first["fits"]
    hbm = 0.85 * first["peak_device_bytes"] / GIB
    seen = []

    def counting(c, h):
        seen.append(c)
        return fit.default_compile(c, h)

    r = fit.fit_search(
        cfg, 8, hbm, headroom=0.0, max_compiles=4, compile_fn=counting, offload=False
    )
    assert r["fits"], r
    assert r["best"]["overrides"] != first["overrides"]
    best = r["best"]
    assert best["peak_device_bytes"] <= hbm * GIB
    assert 1 <= len(seen) <= 4
    # Independently: memory_report of the chosen overrides compiles under the budget.
    chosen = load_config(overrides={**_as_dict(FIT), **best["overrides"]})
    report = memory_report(chosen, hbm_gib=hbm)
    assert report["fits"] and report["peak_device_bytes"] == best["peak_device_bytes"]
    assert r["train_line"].startswith("expertax train model_name=mixtral-tiny ")
    for k, v in best["overrides"].items():
        assert f"{k}={str(v).lower() if isinstance(v, bool) else v}" in r["train_line"]
    assert "FITS" in fit_table.format_fit(r)


@pytest.mark.usefixtures("persistent_compile_cache")
def test_no_candidate_fits_exit_1_names_the_closest(tmp_path, capsys):
    out = tmp_path / "fit.json"
    rc = cli.main(
        ["memory", *TINY, "--fit", "--hbm", "0.0001", "--max-compiles", "1", "--json", str(out)]
    )
    assert rc == 1
    captured = capsys.readouterr()
    assert "NO CANDIDATE FITS: the closest compiled" in captured.out
    assert "over the" in captured.out and "[fit] compile 1:" in captured.err
    r = json.loads(out.read_text())["fit"]
    assert r["best"]["fits"] is False and r["best"]["over_bytes"] > 0
    assert r["best"]["peak_device_bytes"] > 0.0001 * GIB
    assert r["compiled"] == 1 and r["candidates"][0]["peak_device_bytes"] is not None


def _as_dict(items: list[str]) -> dict:
    return dict(item.split("=", 1) for item in items)


def test_a_compiler_error_skips_the_candidates_of_its_remat_and_offload(cfg):
    """The first remat choice tried fails to compile (an internal error, not memory): no other
    candidate of that choice is compiled, and the search goes on to another that fits."""
    seen: list[tuple] = []
    failing: list[tuple] = []

    def compile_fn(c, hbm):
        label = (
            c.remat_policy, *(getattr(c, n) for n in remat.ALL_NAMES),
            c.optimizer_memory_host_offload, c.parameter_memory_host_offload,
        )  # fmt: skip
        seen.append(label)
        if not failing:
            failing.append(label)
        if label == failing[0]:
            raise RuntimeError("INTERNAL: during context [end-of-post-layout_assignment]")
        return 1000

    r = fit.fit_search(cfg, 8, 1.0, headroom=0.0, max_compiles=6, compile_fn=compile_fn)
    assert seen.count(failing[0]) == 1, seen
    assert r["fits"] and len(seen) >= 2
    assert any("failed to compile" not in e and "INTERNAL" in e for e in r["errors"])


def test_muon_state_and_newton_schulz_in_the_plan(cfg):
    """With opt_type=muon the matrices Muon takes keep one moment, not two (the estimate's
    optimizer bytes drop by their second moments exactly), the update holds the largest leaf's
    Newton-Schulz working set, and the step-time model's compute carries the Newton-Schulz FLOPs
    shared by the devices."""
    shape = {"pipeline": 1, "data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
    muon_cfg = cfg.model_copy(update={"opt_type": "muon"})
    adamw, with_muon = estimate.Estimator(cfg), estimate.Estimator(muon_cfg)
    elems = with_muon.state_bytes(shape, "default")
    trainable, second, leaf = elems.trainable, elems.second, elems.muon_leaf
    assert adamw.state_bytes(shape, "default").second == trainable > second > 0
    assert adamw.state_bytes(shape, "default").muon_leaf == 0 < leaf < trainable - second
    assert elems.muon_leaf <= elems.largest == adamw.state_bytes(shape, "default").largest
    o = {"sharding_rules": "default", "remat_policy": "none", "num_vocab_tiling": 1}
    saved = adamw.terms(o, shape).args - with_muon.terms(o, shape).args
    assert saved == (trainable - second) * 4  # float32 second moments
    # the update's Newton-Schulz working set: the largest leaf's moment and three float32 arrays
    assert with_muon.terms(o, shape).update - adamw.terms(o, shape).update == leaf * 16
    flops = muon.newton_schulz_flops(muon_cfg, decoder.spec(muon_cfg))
    assert flops > 0
    assert steptime.Model(muon_cfg, None, 8).optimizer == flops / 8
    assert steptime.Model(cfg, None, 8).optimizer == 0.0
