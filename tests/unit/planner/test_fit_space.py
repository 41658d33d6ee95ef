"""The fit search's parts without a compile: the placement ladders and what they recompute, the
estimate's terms, the per-term calibration, the step-time estimate and the host budget."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from expertax.parallel import remat
from expertax.planner import calibrate, placements, space, steptime
from expertax.planner.estimate import EXPANDED_COPIES, Estimator, Terms, context_gather
from expertax.preflight import load_config
from expertax.targets import CHIPS

SHAPE = {"pipeline": 1, "data": 1, "fsdp": 4, "expert": 2, "tensor": 1}
BASE = {"sharding_rules": "default", "num_vocab_tiling": 1, "num_moe_token_chunks": 1}


@pytest.fixture(scope="module")
def cfg():
    return load_config(overrides={"model_name": "deepseek3-tiny", "per_device_batch_size": 2})


def test_ladders_offload_the_tiers_in_order(cfg):
    choices = {ch.label: ch for ch in placements.ladders(cfg, offload=True, stash=True)}
    assert [lb for lb in choices if lb.startswith("offload-")] == [
        f"offload-{k}" for k in range(1, 6)
    ]
    first = choices["offload-1"].placements()
    assert first[remat.DECODER_LAYER_INPUT] == remat.OFFLOAD
    assert sum(p == remat.OFFLOAD for p in first.values()) == 1
    second = choices["offload-2"].placements()
    assert second[remat.OUT_PROJ] == remat.OFFLOAD and second[remat.MLA_Q] == remat.REMAT
    mixed = choices["input+device-3"].placements()
    assert mixed[remat.DECODER_LAYER_INPUT] == remat.OFFLOAD and mixed[remat.MLA_Q] == remat.DEVICE
    # Only names some stack keeps: qkv_proj and mlpwo never are (remat.unkept).
    for ch in choices.values():
        place = ch.placements()
        assert place[remat.QKV_PROJ] == remat.REMAT and place[remat.MLPWO] == remat.REMAT
    assert choices["stash-all"].as_dict["moe_paged_stash"] is True
    # Without pinned host memory nothing offloads; without the stash, no stash choices.
    plain = placements.ladders(cfg, offload=False, stash=False)
    assert plain == [] and all(not ch.offloads for ch in plain)


def test_recompute_falls_along_the_ladder_and_matches_the_presets(cfg):
    def share(ch):
        return space._share(cfg, ch)

    ladder = [
        ch
        for ch in placements.ladders(cfg, offload=True, stash=False)
        if ch.label.startswith("offload-")
    ]
    shares = [share(ch) for ch in ladder]
    assert shares == sorted(shares, reverse=True) and shares[-1] == 0.0
    # The presets, by the parts their saved names spare (the dense MLP's output is never
    # read by the backward pass, so not even `full` recomputes it).
    presets = {p: space.recompute_share(cfg, p) for p in space.remat_presets(cfg)}
    assert presets["full"] == shares[0] > 0.9 and presets["none"] == 0.0
    assert 0 < presets["minimal"] < presets["save_dot_except_mlp"] < presets["save_out_proj"] < 1


def test_terms_move_with_the_levers(cfg):
    est = Estimator(cfg, "tpu")
    t = lambda **kw: est.terms({**BASE, "remat_policy": "full", **kw}, SHAPE)
    full = t()
    offloaded = t(remat_policy="custom", decoder_layer_input=remat.OFFLOAD)
    assert offloaded.residual_device < full.residual_device and offloaded.residual_host > 0
    assert offloaded.residual_host == full.residual_device - offloaded.residual_device
    opt = t(optimizer_memory_host_offload=True)
    assert opt.args < full.args and opt.state_host == full.args - opt.args
    # AdamW streams the offloaded state (train/streamed_update.py): no whole copy in the
    # update; the TPU program's device share of it is the calibration's `state` ratio
    assert opt.update == 0 and opt.opt_offloaded == opt.state_host
    assert opt.peak({"state": 0.5}) - opt.peak({"state": 0.0}) == opt.opt_offloaded // 2
    params = t(optimizer_memory_host_offload=True, parameter_memory_host_offload=True)
    assert params.args == 0 and params.params_offloaded == full.grads  # (float32 both)
    # the parameters are copied to device whole, and then the update takes the state whole
    assert params.update == params.opt_offloaded and params.peak() >= opt.peak()
    chunked = t(num_moe_token_chunks=4)
    assert chunked.working != full.working
    queries = t(num_attention_token_chunks=4)  # a quarter of the queries' kernel residuals
    assert queries.working < full.working and queries.residual_device == full.residual_device
    stash = t(remat_policy="custom", moe_mlpwo=remat.DEVICE, moe_paged_stash=True)
    assert stash.residual_device > full.residual_device  # the stash's buffer on top
    assert full.stack_copies > 0  # the TPU program's whole-stack copies
    step = full.args + full.grads + full.residual_device + full.working + full.stack_copies
    assert full.peak() == step


def test_gpu_estimate_counts_the_expert_weights_relayout_where_their_model_dim_is_split(cfg):
    """GPU: with the model dim D of the expert weights split over fsdp (the default rules) the
    program copies the stacked weights into another layout (docs/design/ep.md); with each
    expert whole (`exp-fsdp`) it does not. TPU: no such copy is counted."""
    o = {**BASE, "remat_policy": "full"}
    gpu, tpu = Estimator(cfg, "gpu"), Estimator(cfg, "tpu")
    moe = 3 * cfg.num_moe_layers * cfg.num_experts * cfg.base_emb_dim * cfg.base_moe_mlp_dim
    assert gpu.expert_relayout_elems(SHAPE, "default") == moe // 8  # E / expert, D / fsdp
    assert gpu.expert_relayout_elems(SHAPE, "exp-fsdp") == 0
    assert tpu.expert_relayout_elems(SHAPE, "default") == 0
    # either way the MoE layer computes with E split over `expert` alone (act_exp): the layer's
    # gathered weights are the same
    assert gpu.state_bytes(SHAPE, "exp-fsdp")[2] == gpu.state_bytes(SHAPE, "default")[2]

    def diff(est):  # the working set's default - exp-fsdp difference on a platform
        exp_fsdp = {**o, "sharding_rules": "exp-fsdp"}
        return est.terms(o, SHAPE).working - est.terms(exp_fsdp, SHAPE).working

    assert diff(gpu) - diff(tpu) == moe // 8 * 4  # the copy, in float32 (weight_dtype)


def test_calibration_learns_each_term(cfg):
    cal = calibrate.Calibration("tpu")
    prior = {
        "residual": calibrate.RESIDUAL_PRIOR["tpu"],
        "offload": calibrate.OFFLOAD_PRIOR["tpu"],
        "working": calibrate.WORKING_PRIOR["tpu"],
        "state": calibrate.STATE_PRIOR["tpu"],
    }
    assert cal.ratios() == prior
    terms = lambda res: Terms(100, 10, res, 0, 50, 0, 0)
    # Two programs of one working key: temporaries grow 3 bytes per residual byte, and the
    # rest is twice the modelled working set.
    for res in (20, 40):
        temp = 10 + 3 * res + 2 * 50
        cal.add(("k",), terms(res), calibrate.Measured(100 + temp, 100, temp, 0))
    r = cal.ratios(("k",))
    assert r["residual"] == pytest.approx(3.0) and r["working"] == pytest.approx(2.0)
    assert r["args"] == pytest.approx(1.0) and r["offload"] == calibrate.OFFLOAD_PRIOR["tpu"]
    assert terms(30).peak(r) == 100 + 10 + 90 + 100
    # Another key takes the pooled working ratio; a refused program teaches nothing.
    assert cal.ratios(("other",))["working"] == pytest.approx(2.0)
    cal.add(("x",), terms(5), None)
    assert len(cal.compiled) == 2


def test_calibration_blames_offloaded_state_not_every_working_set():
    """A candidate with optimizer state offloaded whose program holds more than the prior share
    of that state corrects the `state` ratio; the working ratio stays what the candidates with
    their state on device say, so candidates without offload are not pruned for it."""
    cal = calibrate.Calibration("tpu")
    plain = Terms(100, 10, 0, 0, 50, 0, 0)
    cal.add(("k",), plain, calibrate.Measured(100 + 10 + 100, 100, 110, 0))  # working x 2
    offloaded = Terms(0, 10, 0, 0, 50, 100, 0, opt_offloaded=100)
    cal.add(("k",), offloaded, calibrate.Measured(10 + 100 + 150, 0, 260, 100))  # 1.5 x state
    r = cal.ratios(("k",))
    assert r["working"] == pytest.approx(2.0) and r["state"] == pytest.approx(1.5)
    assert plain.peak(r) == 210 and offloaded.peak(r) == 260
    # without a candidate of state on device the working set keeps its ratio of all candidates,
    # with the state's share at the prior
    alone = calibrate.Calibration("tpu")
    alone.add(("k",), offloaded, calibrate.Measured(260, 0, 260, 100))
    assert alone.ratios(("k",))["state"] == calibrate.STATE_PRIOR["tpu"]


def test_a_whole_copy_of_the_offloaded_state_has_its_own_ratio():
    """An update that copies the offloaded state in whole (not streamed: Muon, or the
    parameters offloaded too) holds all of it through the backward: its candidates count the
    whole state (the `whole` ratio, 1 until one is compiled), set the streamed candidates'
    `state` ratio no more than those set theirs."""
    cal = calibrate.Calibration("tpu")
    streamed = Terms(0, 10, 0, 0, 50, 100, 0, opt_offloaded=100)
    cal.add(("k",), Terms(100, 10, 0, 0, 50, 0, 0), calibrate.Measured(210, 100, 110, 0))
    cal.add(("k",), streamed, calibrate.Measured(10 + 100 + 30, 0, 140, 100))  # 0.3 x state
    whole = Terms(0, 10, 0, 0, 50, 100, 100, opt_offloaded=100, opt_whole=True)
    cal.add(("k",), whole, calibrate.Measured(10 + 100 + 100, 0, 210, 100))
    r = cal.ratios(("k",))
    assert r["state"] == pytest.approx(0.3) and r["whole"] == pytest.approx(1.0)
    assert streamed.peak(r) == 140 and whole.peak(r) == 210
    assert whole.state_share() == 1.0 and streamed.state_share(r) == pytest.approx(0.3)
    # one holding more than its state (what comes with the copy) moves its own kind's ratio
    more = calibrate.Calibration("tpu")
    more.add(("k",), streamed, calibrate.Measured(140, 0, 140, 100))
    more.add(("k",), whole, calibrate.Measured(10 + 100 + 150, 0, 260, 100))
    r = more.ratios(("k",))
    assert r["whole"] > 1.4 and whole.peak(r) == pytest.approx(260, abs=1)
    alone = calibrate.Calibration("tpu")
    alone.add(("k",), streamed, calibrate.Measured(140, 0, 140, 100))
    assert r["working"] == alone.ratios(("k",))["working"]  # the whole copy moved only its own
    assert streamed.peak(r) == streamed.peak(alone.ratios(("k",)))


def test_step_time_counts_recompute_and_transfers(cfg):
    chip = CHIPS["v5p"]
    model = steptime.Model(cfg, chip)
    none = model.of(0.0, Terms(1, 1, 0, 0, 1, 0, 0))
    full = model.of(1.0, Terms(1, 1, 0, 0, 1, 0, 0))
    assert full.compute_s > none.compute_s and full.recompute_flops > 0 == none.recompute_flops
    moved = model.of(0.0, Terms(1, 1, 0, 10**12, 1, 0, 0))
    assert moved.activation_transfer_s == pytest.approx(10**12 / chip.host.link_bytes_per_s)
    # the experts' weights read and their gradients written: the tiny model's step is bound by them
    assert moved.memory_s == none.memory_s > 0
    overlapped = max(moved.compute_s, moved.activation_transfer_s)
    assert moved.seconds == pytest.approx(overlapped + moved.memory_s)
    state = model.of(0.0, Terms(1, 1, 0, 0, 1, 10**12, 10**12))
    assert state.seconds == pytest.approx(
        none.compute_s + none.memory_s + 2 * 10**12 / chip.host.link_bytes_per_s
    )


def test_gpu_targets_search_no_state_offload(cfg):
    on_gpu = space.candidates(cfg, 8, state_offload=False, on="gpu")
    assert on_gpu and not any(x.overrides.get("optimizer_memory_host_offload") for x in on_gpu)
    assert any(x.terms.residual_host for x in on_gpu)  # activations still offload
    labels = {x.remat_label for x in on_gpu}
    assert {"offload-1", "stash-out", "full", "minimal"} <= labels
    assert {x.overrides["num_moe_token_chunks"] for x in on_gpu} == set(space.CHUNKS)


def test_attention_chunks_are_searched_and_cost_a_replay(cfg, monkeypatch):
    assert cfg.max_target_length < space.ATT_CHUNKS_MIN_LENGTH  # too short to chunk: none
    assert {x.overrides["num_attention_token_chunks"] for x in space.candidates(cfg, 8)} == {1}
    monkeypatch.setattr(space, "ATT_CHUNKS_MIN_LENGTH", cfg.max_target_length)
    found = space.candidates(cfg, 8, on="tpu")
    by = {}
    for x in found:
        o = x.overrides
        by.setdefault((o["remat_policy"], o["num_attention_token_chunks"]), x)
    assert {n for _, n in by} == {1, 4, 16}
    # each chunk's backward replays its projections and kernel (not without remat)
    assert by[("full", 4)].recompute_share > by[("full", 1)].recompute_share
    assert by[("none", 4)].recompute_share == by[("none", 1)].recompute_share == 0.0
    assert by[("full", 16)].terms.working < by[("full", 1)].terms.working


def test_every_target_has_its_host():
    for name, chip in CHIPS.items():
        assert chip.host is not None and chip.host.chips in (4, 8), name
        assert chip.host.ram_gib > 100 and chip.host.link_bytes_per_s > 1e10


def test_grouped_padding_follows_the_kernels_row_tiles():
    """Balanced rows per local expert r = tokens x K x expert / E per chunk: megablox (TPU)
    covers them with power-of-two tiles of 16-512 rows, tokamax's Triton kernel (GPU) with
    at most 128, so a group of 384 rows costs 512 on TPU (+1/3) and 384 on GPU."""
    c = load_config(
        overrides={
            "model_name": "deepseek3-671b",
            "per_device_batch_size": 6,
            "max_target_length": 8192,
        }
    )
    # 6 x 8192 / 64 chunks x 8 x 16 / 256 = 384 rows per group
    assert steptime.grouped_padding(c, 16, 64, "tpu") == pytest.approx(1 / 3)
    assert steptime.grouped_padding(c, 16, 64, "gpu") == 0.0
    assert steptime.grouped_padding(c, 16, 8, "tpu") == 0.0  # 3,072 rows: six tiles of 512
    model = steptime.Model(c, CHIPS["v5p"])
    terms = Terms(1, 1, 0, 0, 1, 0, 0)
    assert model.of(0.5, terms, padding=1 / 3).compute_s > model.of(0.5, terms).compute_s


def test_token_chunks_cost_the_expert_weights_hbm_traffic():
    """Each MoE token chunk reads the local experts' bf16 weights again (forward, input
    gradient, the replay) and adds its weight gradient into the float32 accumulator: at 671B on
    v5p with 64 chunks the e2 layout's traffic outlasts its routed matmuls by far, one chunk's
    not at all, and 128 x fewer local experts (e256) move 128 x fewer bytes."""
    c = load_config(
        overrides={"model_name": "deepseek3-671b", "per_device_batch_size": 6,
                   "max_target_length": 8192}
    )  # fmt: skip
    local = c.num_moe_layers * c.num_experts * 3 * c.base_emb_dim * c.base_moe_mlp_dim / 2
    # 64 chunks: 3 reads of 2 bytes and a float32 read and write per chunk
    assert steptime.expert_weight_traffic(c, 2, 1, 64, 1.0) == 64 * (6 + 8) * local
    assert steptime.expert_weight_traffic(c, 2, 1, 1, 0.0) == (4 + 4) * local  # written once
    assert steptime.expert_weight_traffic(c, 256, 1, 64, 1.0) * 128 == pytest.approx(
        steptime.expert_weight_traffic(c, 2, 1, 64, 1.0)
    )
    model = steptime.Model(c, CHIPS["v5p"])
    terms = Terms(1, 1, 0, 0, 1, 0, 0)
    layout = {"ici_expert_parallelism": 2, "ici_fsdp_parallelism": 256}
    chunked = model.of(1.0, terms, overrides={**layout, "num_moe_token_chunks": 64})
    whole = model.of(1.0, terms, overrides={**layout, "num_moe_token_chunks": 1})
    assert chunked.memory_s > 50 and whole.memory_s == 0.0
    assert chunked.seconds == pytest.approx(whole.seconds + chunked.memory_s)
    assert steptime.Model(c).of(1.0, terms, overrides=layout).memory_s == 0.0  # the CPU proxy


def test_accelerators_search_no_moe_offload_inside_moe_chunks():
    """A MoE name offloaded inside MoE token chunks does not compile on GPU or TPU
    (parallel.checks.check_moe_chunk_offload): those candidates are left out there, kept on a
    CPU."""
    c = load_config(overrides={"model_name": "mixtral-tiny", "max_target_length": 64})

    def bad(x):
        # the presets offload no MoE name; a custom choice names each placement
        moe_offload = any(x.overrides.get(n) == remat.OFFLOAD for n in remat.STASHABLE)
        return x.overrides["num_moe_token_chunks"] > 1 and moe_offload

    for on in ("gpu", "tpu"):
        assert not any(bad(x) for x in space.candidates(c, 8, on=on, state_offload=False))
    assert any(bad(x) for x in space.candidates(c, 8, on="cpu", state_offload=False))


def test_context_is_searched_where_a_batch_shard_holds_one_sequence():
    """Half a sequence per device on 8 devices (4 sequences): context 2 with fsdp x expert = 4;
    one sequence per device (negative control): no context split, the batch splits instead."""
    over = {"model_name": "deepseek3-tiny", "max_target_length": 4096}
    half = load_config(overrides={**over, "per_device_batch_size": 0.5})
    assert space.context_sizes(half, 8) == [1, 2, 4]  # 4096 / 4 = 1024 tokens per device
    found = space.layouts(half, 8)
    by_cp = {cp: [x for x in found if x["context"] == cp] for cp in (1, 2, 4)}
    assert by_cp[2] and not by_cp[4]  # 4 sequences cannot fill fsdp x expert = 2
    assert all(x["fsdp"] * x["expert"] == 4 for x in by_cp[2])
    assert all(x["fsdp"] * x["expert"] * x["context"] * x["tensor"] == 8 for x in found)
    whole = load_config(overrides={**over, "per_device_batch_size": 1})
    assert {x["context"] for x in space.layouts(whole, 8)} == {1}
    short = load_config(overrides={**over, "max_target_length": 1024})
    assert space.context_sizes(short, 8) == [1]  # below MIN_CONTEXT_TOKENS per device
    # an MLA model's context splits pass the latent round a ring (latent_ring.py); GQA's gather
    few = space.candidates(
        half, 8, on="tpu", pinned_host=False, state_offload=False,
        buildable=lambda x: x["expert"] == 1 and x["tensor"] == 1,
    )  # fmt: skip
    assert {x.overrides["ici_context_parallelism"] for x in few} == {2}
    for x in few:
        ring = x.overrides.get("context_parallel_strategy") == "ring"
        assert ring == (x.overrides["ici_context_parallelism"] > 1), x.overrides
    assert not space.ring_context(load_config(overrides={"model_name": "mixtral-tiny"}), "auto")


def test_context_splits_the_estimate_along_the_sequence():
    """The saved residuals per device halve under context 2, attention holds the gathered
    latent and one up-projected key block besides, and the weights shard over context."""
    over = {"model_name": "deepseek3-tiny", "max_target_length": 2048}
    c = load_config(overrides={**over, "per_device_batch_size": 0.5})
    est = Estimator(c, "tpu")
    o = {**BASE, "remat_policy": "full", "ici_context_parallelism": 2}
    split = {"pipeline": 1, "data": 1, "fsdp": 4, "context": 2, "expert": 1, "tensor": 1}
    whole = {**split, "context": 1, "data": 2}  # the same devices, the batch split instead
    cp, plain = est.terms(o, split), est.terms(o, whole)
    assert abs(2 * cp.residual_device - plain.residual_device) <= 2
    dt, h = jnp.dtype(c.dtype).itemsize, c.base_num_query_heads  # no tensor split
    latent = c.max_target_length * (c.kv_lora_rank + c.qk_rope_head_dim) * dt
    block = 512 * h * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * dt
    assert context_gather(c, 1, h, 2) == latent + block and context_gather(c, 1, h, 1) == 0
    # the ring holds its own share and its float32 gradients twice each, not the sequence
    share = c.max_target_length // 8 * (c.kv_lora_rank + c.qk_rope_head_dim)
    assert context_gather(c, 1, h, 8, "ring") == share * (2 * dt + 8) + block
    assert context_gather(c, 1, h, 8, "ring") < context_gather(c, 1, h, 8)
    # splash (and dot) up-project the whole gathered sequence: its keys, values and gradients
    up = c.max_target_length * h * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * dt
    assert context_gather(c, 1, h, 2, impl="splash") == latent + EXPANDED_COPIES * up
    assert est.terms(o, split).working != est.terms(o, {**split, "context": 1}).working
    # embed and the low-rank dims shard over fsdp x context: fewer parameters per device
    assert est.state_bytes(split, "default")[0] < est.state_bytes(whole, "default")[0]
    assert space.Candidate({**o, **_mesh_keys(split)}, cp, (), "full", 0.0).layout == "e1 f4 t1 c2"


def _mesh_keys(shape):
    return {f"ici_{a}_parallelism": n for a, n in shape.items() if a not in ("pipeline", "data")}


def test_equal_step_times_rank_by_collective_bytes():
    """A long MLA sequence: the heads over `tensor` all-reduce [tokens, D] activations, the
    tokens over `context` gather a 576-wide latent; the fit ranks the context split first when
    the compute ties, and a split of nothing moves nothing."""
    from expertax.planner import fit

    c = load_config(
        overrides={
            "model_name": "deepseek3-671b",
            "per_device_batch_size": 0.25,
            "max_target_length": 131072,
        }  # fmt: skip
    )
    layers, tokens = c.num_dense_layers + c.num_moe_layers, 0.25 * 131072
    tensor, context = steptime.exchange_bytes(c, 4, 1), steptime.exchange_bytes(c, 1, 4)
    assert steptime.exchange_bytes(c, 1, 1) == 0
    assert tensor == layers * 4 * 2 * 0.75 * tokens * 4 * 7168 * 2
    assert context == layers * (2 + 2 + 4) * 0.75 * tokens * 4 * (512 + 64)
    assert tensor / context == pytest.approx(2 * 7168 / 576)  # 4 16-bit all-reduces: 2x
    model = steptime.Model(c, CHIPS["h100"])
    terms = Terms(0, 0, 0, 0, 0, 0, 0)
    ranked = []
    for split in ({"ici_tensor_parallelism": 4}, {"ici_context_parallelism": 4}):
        x = space.Candidate({**BASE, **split}, terms, (), "full", 0.0)
        x.step = model.of(0.0, terms, overrides=split)
        ranked.append(x)
    assert ranked[0].step.seconds == ranked[1].step.seconds
    assert min(ranked, key=fit._rank) is ranked[1]
