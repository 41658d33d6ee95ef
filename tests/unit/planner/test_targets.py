"""Compile targets: parsing, topologies, the platform that follows the mesh, and the TPU and GPU
compilers run from this CPU machine on the tiny models (compile-only: nothing executes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from expertax import cli, platform, targets
from expertax.config import ConfigError
from expertax.nn.moe import strategy
from expertax.planner import plan
from expertax.preflight import load_config
from expertax.sharding.mesh import buildable
from expertax.train.trainer import build_trainer

needs_tpu = pytest.mark.skipif(
    not targets.compiler_available("tpu"), reason="the TPU compiler (expertax[tpu]) is missing"
)
needs_gpu = pytest.mark.skipif(
    not targets.compiler_available("gpu"), reason="the GPU compiler (expertax[gpu]) is missing"
)


@pytest.mark.parametrize(
    "spec, platform_, count, topology",
    [
        ("cpu", "cpu", 0, ""),
        ("tpu:v5p-16", "tpu", 8, "v5p:2x2x2"),
        ("tpu:v5p-8", "tpu", 4, "v5p:2x2x1"),
        ("tpu:v5p-256", "tpu", 128, "v5p:4x4x8"),
        ("tpu:v5p-1024", "tpu", 512, "v5p:8x8x8"),
        ("tpu:v5p-2048", "tpu", 1024, "v5p:8x8x16"),
        ("TPU:v6e-256", "tpu", 256, "v6e:16x16"),
        ("tpu:v5e-8", "tpu", 8, "v5e:2x4"),
        ("gpu:h100x8", "gpu", 8, "1x1x8"),
        ("gpu:h100x4", "gpu", 4, "1x1x4"),
        ("gpu:h100x256", "gpu", 256, "1x32x8"),
        ("gpu:h200x128", "gpu", 128, "1x16x8"),
    ],
)
def test_target_names_map_to_topologies(spec, platform_, count, topology):
    t = targets.parse_target(spec)
    assert (t.platform, t.count, t.topology) == (platform_, count, topology)
    if t.chip is not None:
        assert t.hbm_gib > 10


@pytest.mark.parametrize(
    "spec, says",
    [
        ("tpu:v5p-15", "power of two"),
        ("tpu:v5p-12", "power of two"),
        ("tpu:v9-8", "tpu:<v5p|v5e|v6e>-<N>"),
        ("gpu:h100x12", "whole hosts of 8"),
        ("gpu:a100x8", "gpu:<h100, h200>x<count>"),
        ("gpu:h100", "gpu:<h100, h200>x<count>"),
        ("cuda:h100x8", "cpu, tpu or gpu"),
    ],
)
def test_bad_targets_are_refused_naming_what_is_valid(spec, says):
    with pytest.raises(ConfigError) as e:
        targets.parse_target(spec)
    assert f"--target={spec}" in str(e.value) and says in str(e.value)
    assert "gpu:h100x8" in str(e.value)


def test_a_missing_compiler_is_refused_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setattr(targets, "compiler_available", lambda p: p == "cpu")
    rc = cli.main(["memory", "model_name=llama-tiny", "--target", "tpu:v5p-16"])
    err = capsys.readouterr().err
    assert rc == 2 and "expertax[tpu]" in err and "not installed" in err
    rc = cli.main(["memory", "model_name=llama-tiny", "--target", "gpu:h100x8"])
    assert rc == 2 and "expertax[gpu]" in capsys.readouterr().err


def test_devices_flag_is_for_the_cpu_target_only(capsys):
    rc = cli.main(["memory", "model_name=llama-tiny", "--target", "tpu:v5p-16", "--devices", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "--devices=4" in err and "8 devices of its own" in err


def test_compiler_refusals_for_memory_are_recognised():
    tpu = RuntimeError(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (100.50G) exceeds available HBM (95.74G)."
    )
    why = plan.refused_for_memory(tpu)
    assert "100.50G" in why
    assert plan.refused_peak(why, ()) == int(100.5 * plan.GIB)  # no state: the temporaries
    # a state holding a PRNG key (the trainer's dropout key): its bytes count, no crash
    state = {
        "w": jax.ShapeDtypeStruct((4, 8), jnp.float32),
        "rng": jax.eval_shape(jax.random.key, 0),
    }
    assert plan.refused_peak(why, state) == int(100.5 * plan.GIB) + 4 * 8 * 4 + 8
    assert plan.refused_for_memory(ValueError("shapes do not match")) is None


@needs_tpu
def test_meshes_a_torus_cannot_take_whole_are_split_or_refused():
    devices = targets.parse_target("tpu:v5p-1024").devices()
    assert len(devices) == 512 and platform.of_devices(devices) == "tpu"
    assert buildable({"expert": 16, "fsdp": 32}, devices)  # splits physical axes
    assert buildable({"expert": 8, "fsdp": 64}, devices)
    assert not buildable({"expert": 3, "fsdp": 2}, devices[:6])


@needs_tpu
@needs_gpu
def test_backend_decisions_follow_the_mesh_not_the_default_backend():
    c = load_config(overrides={"model_name": "deepseek3-tiny", "ici_expert_parallelism": 8})
    assert strategy.resolve_a2a_impl(c) == "padded"  # XLA:CPU: the padded stand-in
    for spec in ("tpu:v5p-16", "gpu:h100x8"):
        t = targets.parse_target(spec)
        trainer = build_trainer(c, t.devices())
        with trainer.context():
            assert platform.current() == t.platform
            assert strategy.resolve_a2a_impl(c) == "ragged"
        assert platform.current() == "cpu"


@needs_tpu
@needs_gpu
@pytest.mark.parametrize(
    # both in the extended run (whole steps compiled for a target, 30-50 s each); the GPU one's
    # compile of offloaded names and its "NOT HONOURED" report run nowhere else
    "spec",
    [pytest.param(spec, marks=pytest.mark.extended) for spec in ("tpu:v5p-16", "gpu:h100x8")],
)
def test_memory_for_a_target_with_host_offloaded_optimizer_state(spec, tmp_path, capsys):
    """The real compilers take the step with optimizer state and two saved names offloaded (the
    TPU refused it while the PRNG key moved with the state) and the native ragged all-to-all:
    both programs hold the offloaded activations in pinned host memory; the TPU program holds
    the state there too, the GPU compile without a GPU does not (reported, not subtracted)."""
    path = tmp_path / "m.json"
    args = ["model_name=deepseek3-tiny", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2"]
    args += ["optimizer_memory_host_offload=true", "--top", "0"]
    # and two saved names of every layer offloaded (the fit search's offload-2 placement)
    args += ["remat_policy=custom", "decoder_layer_input=offload", "out_proj=offload"]
    program = tmp_path / "step.hlo"
    rc = cli.main(
        ["memory", *args, "--target", spec, "--json", str(path), "--save-program", str(program)]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    r = json.loads(path.read_text())
    _check_step_time(r, program, spec, tmp_path)
    t = targets.parse_target(spec)
    assert r["target"] == spec and r["backend"] == t.platform
    assert r["hbm_bytes"] == int(t.hbm_gib * plan.GIB) and r["fits"] is True
    assert r["peak_device_bytes"] > 0
    activations = r["residual_bytes_host"]  # the offloaded names, from the traced layers
    assert activations > 0
    if t.platform == "tpu":  # the TPU program holds the state in pinned host memory
        assert r["not_honoured"] == []
        # the state and offloaded activations (the program's figure: with the layer scan and
        # expert parallelism here it holds less than all layers' offloaded names at once)
        assert r["host_bytes"] > r["optimizer_state_bytes"]
        # AdamW's update streams the stacked moments one layer at a time
        # (train/streamed_update.py): slices read from and written to pinned host memory (S(5)),
        # not the whole stack copied to device memory
        text = program.read_text()
        sliced = [x for x in text.splitlines() if "dynamic-slice" in x and "S(5)" in x]
        updated = [x for x in text.splitlines() if "dynamic-update-slice" in x and "S(5)" in x]
        assert sliced and updated and "train/streamed_update.py" in text
    else:  # the GPU compile without a GPU keeps it on device: said, not subtracted
        assert len(r["not_honoured"]) == 1 and "not honoured" in r["not_honoured"][0]
        assert "NOT HONOURED: optimizer_memory_host_offload=true" in out
        assert 0.5 * activations <= r["host_bytes"] <= 1.5 * activations
    for key in ("compiled_flops", "model_flops", "host_bytes", "peak_device_bytes"):
        assert key in r
    assert r["model_flops"] > 0
    assert t.describe() in out and "XLA:CPU" not in out


def _check_step_time(r: dict, program, spec: str, tmp_path) -> None:
    """The report's step time, predicted from the program on the target's links: its parts add
    up, the collectives name the mesh axes they run along, the offloaded activations cross the
    host link; `expertax steptime` on the saved program says the same."""
    s = r["step_time"]
    assert s["method"] == "predicted from the compiled program, not measured"
    parts = s["compute_seconds"] + s["exposed_communication_seconds"] + s["exposed_host_seconds"]
    assert s["seconds"] >= parts * 0.999 and s["seconds"] > 0
    axes = {a for c in s["communication"] for a in c["mesh_axes"]}
    assert {"expert", "fsdp"} <= axes, s["communication"]
    assert s["host_transfer_seconds"] > 0
    assert 0 < s["mfu"] < 1
    tpu = spec.startswith("tpu")
    assert s["placement"] == (
        "the mesh's device coordinates" if tpu else "the mesh's device ids, 8 per node"
    )
    again = tmp_path / "again.json"
    assert cli.main(["steptime", str(program), "--json", str(again)]) == 0
    assert json.loads(again.read_text())["seconds"] == pytest.approx(s["seconds"])


def _routed_ffn_flops(c, trainer) -> float:
    """The routed experts' training FLOPs per device (no remat: forward + 2 x backward):
    6 x 3 matmuls of D x F per routed token slot."""
    tokens = trainer.global_batch * c.max_target_length / trainer.num_devices
    d, f, k = c.base_emb_dim, c.base_moe_mlp_dim, c.num_experts_per_tok
    return 6 * 3 * d * f * k * tokens * c.num_moe_layers


def _gmm_flops(spec, model, **overrides):
    from expertax.planner import flops

    c = load_config(overrides={"model_name": model, "remat_policy": "none", **overrides})
    trainer = build_trainer(c, targets.parse_target(spec).devices())
    count = flops.count_flops(trainer.compile().as_text())
    return count, _routed_ffn_flops(c, trainer)


_GROUPED = (
    "tests/unit/planner/test_targets.py::test_grouped_matmul_costs_the_routed_rows_not_all_experts"
)


def _grouped_cover(spec):
    """The default cases (the whole step on each target) and the kernels' own routed rows."""
    gmm = "tests/unit/nn/moe/test_gmm_kernels.py::"
    kernels = (
        (
            f"{gmm}test_kernels_compile_for_the_target[tpu:v5p-16-megablox-megablox]",
            f"{gmm}test_auto_kernels_cost_the_routed_rows_at_few_rows_per_expert[tpu:v5p-16-megablox-16]",
            f"{gmm}test_kernels_compile_inside_expert_parallel_shard_map[tpu:v5p-16-megablox-megablox]",
        )
        if spec.startswith("tpu")
        else (
            f"{gmm}test_auto_kernels_cost_the_routed_rows_at_few_rows_per_expert"
            "[gpu:h100x8-tokamax_triton-16]",
        )
    )
    return pytest.mark.covered_by(
        f"{_GROUPED}[gpu:h100x8-deepseek3-tiny-mesh0]",
        f"{_GROUPED}[tpu:v5p-16-mixtral-tiny-mesh4]",
        *kernels,
    )


@needs_tpu
@needs_gpu
@pytest.mark.parametrize(
    "spec, model, mesh",
    [
        # deepseek3-tiny on the GPU in CI's extended run (whole steps compiled for a target,
        # 20-30 s each); on the TPU on demand (the tiled case below holds the TPU,
        # test_gmm_kernels.py megablox's routed rows)
        pytest.param(
            "gpu:h100x8",
            "deepseek3-tiny",
            {"ici_expert_parallelism": 4, "ici_fsdp_parallelism": 2},
            marks=pytest.mark.extended,
        ),
        pytest.param(
            "tpu:v5p-16",
            "deepseek3-tiny",
            {"ici_expert_parallelism": 4, "ici_fsdp_parallelism": 2},
            marks=[pytest.mark.full_grid, _grouped_cover("tpu:v5p-16")],
        ),
    ]
    + [
        # one expert per device: on demand (the tiled case below holds it on TPU)
        pytest.param(
            spec,
            "mixtral-tiny",
            {"ici_expert_parallelism": 8},
            marks=[pytest.mark.full_grid, _grouped_cover(spec)],
        )
        for spec in ("tpu:v5p-16", "gpu:h100x8")
    ]
    + [
        pytest.param(
            "tpu:v5p-16",
            "mixtral-tiny",
            {"ici_expert_parallelism": 8, "gmm_impl": "tiled"},
            marks=pytest.mark.extended,
        )
    ],
)
def test_grouped_matmul_costs_the_routed_rows_not_all_experts(spec, model, mesh):
    """The compiled grouped matmul does the routed rows' FLOPs, not a dense matmul over every
    expert: `auto`'s kernels (megablox on TPU, tokamax's Triton kernels on GPU: the tiny models'
    256-512 rows per local expert fill their row blocks) counted at the balanced rows per group
    they name (`rows~R`), and the tiled backend's loops at the balanced trip count they name
    (at one expert per device on TPU: XLA:TPU turned a loop of at most one trip into
    straight-line code, 3x the routed FLOPs, until the item lists got two slots)."""
    count, routed = _gmm_flops(spec, model, **mesh)
    tiled = mesh.get("gmm_impl") == "tiled"
    named = count.expected_trip_counts if tiled else [k for k in count.kernels if k.expected_rows]
    gmm = count.matching("trips~" if tiled else "rows~")
    assert named and 0.9 * routed <= gmm <= 1.1 * routed, (gmm, routed)
    if not tiled:  # per matmul of the expert FFN: forward, input gradient (gmm), weights (tgmm)
        ops = [k.op for k in count.kernels]
        assert ops.count("tgmm") >= 3 and ops.count("gmm") == 2 * ops.count("tgmm"), ops


@needs_gpu
def test_ragged_dot_on_gpu_expands_to_every_expert():
    """The negative control: XLA:GPU compiles jax.lax.ragged_dot as a dense matmul over all
    experts, and the counter sees it."""
    count, routed = _gmm_flops("gpu:h100x8", "mixtral-tiny", gmm_impl="ragged_dot")
    e = load_config(overrides={"model_name": "mixtral-tiny"}).num_experts
    assert count.matching("ragged_dot") > e / 2 * routed / 3  # forward alone is routed / 3


def test_fit_searches_only_meshes_the_topology_can_lay_out(monkeypatch):
    from expertax.planner import space

    # One point per layout (the other levers do not meet the topology).
    monkeypatch.setattr(space, "remat_presets", lambda c: ["full"])
    monkeypatch.setattr(space, "rules_presets", lambda: ["default"])
    monkeypatch.setattr(space, "CHUNKS", (1,))
    monkeypatch.setattr(space, "TILES", (1,))
    c = load_config(overrides={"model_name": "deepseek3-tiny", "mu_dtype": "bfloat16"})
    c = c.model_copy(update={"nu_dtype": "bfloat16"})
    every = {x.layout for x in space.candidates(c, 8, pinned_host=False)}
    only = {
        x.layout
        for x in space.candidates(
            c, 8, pinned_host=False, buildable=lambda shape: shape["expert"] != 4
        )
    }
    assert any(" ".join(x.split()[:1]) == "e4" for x in every)
    assert only and not any(x.startswith("e4 ") for x in only) and only < every


SRC = str(Path(targets.__file__).parents[2])


@needs_gpu
def test_prepare_process_after_jax_is_imported():
    """The command imports JAX (its config modules do) before `prepare_process`: JAX_PLATFORMS
    set then is read too late, and with no platform chosen the CUDA plugin, which cannot load
    CUDA without a GPU, registers no compiler. The GPU target's devices must still be there."""
    code = (
        "import jax\n"
        "from expertax import targets\n"
        "t = targets.parse_target('gpu:h100x8')\n"
        "targets.prepare_process(t)\n"
        "print(len(t.devices()), jax.default_backend())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["8", "cpu"]
