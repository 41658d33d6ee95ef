"""Expert-parallel dispatch: the padded all-to-all, exact round trips, gradients, global stats.

XLA:CPU has no ragged all-to-all (UNIMPLEMENTED), so the padded implementation is checked against
a pure-numpy model of `jax.lax.ragged_all_to_all`'s semantics rather than against the native op;
on a GPU/TPU the same tests would also run a2a_impl=ragged.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from expertax.config import ConfigError, config_rules
from expertax.nn import param
from expertax.nn.moe import ep, exchange, layer, router
from expertax.preflight import load_config
from expertax.sharding import make_mesh, use_rules
from tests.tolerances import tol
from tests.unit.nn.moe.test_moe import with_random_biases

pytestmark = pytest.mark.distributed

EP = 8  # shards on the expert axis


def expert_mesh():
    devices = np.asarray(jax.devices()[:EP]).reshape(1, 1, 1, EP, 1)
    return Mesh(
        devices, ("pipeline", "data", "fsdp", "expert", "tensor"), axis_types=(AxisType.Auto,) * 5
    )


def numpy_ragged_all_to_all(operands, outputs, in_off, send, out_off, recv):
    """The semantics of jax.lax.ragged_all_to_all, one shard per list entry."""
    outputs = [o.copy() for o in outputs]
    for src in range(len(operands)):
        for dst in range(len(operands)):
            n = send[src][dst]
            assert recv[dst][src] == n
            chunk = operands[src][in_off[src][dst] : in_off[src][dst] + n]
            outputs[dst][out_off[src][dst] : out_off[src][dst] + n] = chunk
    return outputs


def exchange_case(rng, rows=12, out_rows=40, empty_peer=True):
    """Random ragged sizes: contiguous chunks per peer, some of them empty."""
    send = rng.integers(0, 3, size=(EP, EP))
    if empty_peer:
        send[:, 3] = 0  # nobody sends to shard 3
        send[5, :] = 0  # shard 5 sends nothing
    in_off = np.cumsum(send, 1) - send
    out_off = np.cumsum(send, 0) - send  # receivers pack by source
    assert send.sum(0).max() <= out_rows and send.sum(1).max() <= rows
    operand = rng.normal(size=(EP, rows, 3)).astype(np.float32)
    return operand, send, in_off, out_off


def numpy_ragged_all_to_all_vjp(ct_outputs, rows, in_off, send, out_off):
    """The transpose of that linear map: (cotangent of each operand, of each initial output)."""
    ct_operands = [np.zeros((rows, *ct.shape[1:]), ct.dtype) for ct in ct_outputs]
    ct_initial = [ct.copy() for ct in ct_outputs]
    for src in range(len(ct_outputs)):
        for dst in range(len(ct_outputs)):
            n, o = send[src][dst], out_off[src][dst]
            ct_operands[src][in_off[src][dst] : in_off[src][dst] + n] = ct_outputs[dst][o : o + n]
            ct_initial[dst][o : o + n] = 0.0  # written rows do not depend on the initial output
    return ct_operands, ct_initial


def _padded_exchange(block_rows):
    def body(x, out, io, ss, oo, rs):
        return exchange.padded_all_to_all(
            x[0], out[0], io[0], ss[0], oo[0], rs[0], axis_name="expert", block_rows=block_rows
        )[None]

    spec = P("expert")
    return jax.shard_map(body, mesh=expert_mesh(), in_specs=(spec,) * 6, out_specs=spec)


# Blocks of 1, 2 and 3 rows take several rounds for the longer chunks; send.max() takes one; 20
# rows are more than a tight receive buffer holds. "tight": the buffer has exactly the rows the
# busiest receiver gets, so blocks near its end are written shifted (exchange._exchange_rounds).
# Each buffer and block once by default, the seeds alternating; the other seed of each on demand
# (-m full_grid): CI's budget. An on-demand case is covered by the same case's default seed.
BLOCK_CASES = [
    ("roomy", 1),
    ("roomy", 2),
    ("roomy", None),
    ("tight", 1),
    ("tight", 3),
    ("tight", 20),
]


def _block_case(i, seed, buffer, block):
    if not (i + seed) % 2:
        return pytest.param(seed, buffer, block)
    default = (
        "tests/distributed/test_ep.py::"
        "test_padded_all_to_all_matches_numpy_ragged_model_with_gradients"
        f"[{1 - seed}-{buffer}-{block}]"
    )
    return pytest.param(
        seed, buffer, block, marks=[pytest.mark.full_grid, pytest.mark.covered_by(default)]
    )


@pytest.mark.parametrize(
    "seed, buffer, block",
    [_block_case(i, seed, *case) for seed in (0, 1) for i, case in enumerate(BLOCK_CASES)],
)
def test_padded_all_to_all_matches_numpy_ragged_model_with_gradients(seed, buffer, block):
    rng = np.random.default_rng(seed)
    operand, send, in_off, out_off = exchange_case(rng)
    out_rows = 40 if buffer == "roomy" else int(send.sum(0).max())
    initial = np.full((EP, out_rows, 3), -7.0, np.float32)  # unwritten rows must keep this
    exchange = _padded_exchange(block or int(send.max()))
    ints = [a.astype(np.int32) for a in (in_off, send, out_off, send.T.copy())]
    got = jax.jit(exchange)(operand, initial, *ints)
    want = numpy_ragged_all_to_all(list(operand), list(initial), in_off, send, out_off, send.T)
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))

    ct = rng.normal(size=initial.shape).astype(np.float32)
    _, vjp = jax.vjp(lambda x, out: exchange(x, out, *ints), operand, initial)
    ct_operand, ct_initial = vjp(ct)
    want_operand, want_initial = numpy_ragged_all_to_all_vjp(
        list(ct), operand.shape[1], in_off, send, out_off
    )
    np.testing.assert_array_equal(np.asarray(ct_operand), np.stack(want_operand))
    np.testing.assert_array_equal(np.asarray(ct_initial), np.stack(want_initial))


def test_native_exchange_gradients_are_the_ragged_transpose(monkeypatch):
    """`a2a_impl=ragged`'s exchange (`exchange._ragged`: the native collective with its own
    transpose, whose zero buffers XLA cannot merge): forward and VJP against the numpy model.
    XLA:CPU has no ragged all-to-all, so the collective is the padded exchange here (the same
    semantics, checked above); what this checks is the transpose's offsets and mask."""
    rng = np.random.default_rng(2)
    operand, send, in_off, out_off = exchange_case(rng)
    initial = np.full((EP, int(send.sum(0).max()), 3), -7.0, np.float32)
    block = int(send.max())

    def native(x, out, io, ss, oo, rs, *, axis_name):
        return exchange.padded_all_to_all(
            x, out, io, ss, oo, rs, axis_name=axis_name, block_rows=block
        )

    monkeypatch.setattr(jax.lax, "ragged_all_to_all", native)

    def body(x, out, io, ss, oo, rs):
        args = (x[0], out[0], io[0], ss[0], oo[0], rs[0])
        return exchange.all_to_all("ragged", *args, block_rows=block)[None]

    spec = P("expert")
    fn = jax.shard_map(body, mesh=expert_mesh(), in_specs=(spec,) * 6, out_specs=spec)
    ints = [a.astype(np.int32) for a in (in_off, send, out_off, send.T.copy())]
    got, vjp = jax.vjp(lambda x, out: fn(x, out, *ints), operand, initial)
    want = numpy_ragged_all_to_all(list(operand), list(initial), in_off, send, out_off, send.T)
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))
    ct = rng.normal(size=initial.shape).astype(np.float32)
    ct_operand, ct_initial = vjp(ct)
    want_operand, want_initial = numpy_ragged_all_to_all_vjp(
        list(ct), operand.shape[1], in_off, send, out_off
    )
    np.testing.assert_array_equal(np.asarray(ct_operand), np.stack(want_operand))
    np.testing.assert_array_equal(np.asarray(ct_initial), np.stack(want_initial))


def _plan_roundtrip(experts_PNK, buffer_factor=-1.0, num_experts=16):
    """Rank-coded rows through sort_and_send, the local sort, its undoing and send_back with an
    identity FFN."""
    n, k = experts_PNK.shape[1:]
    c = load_config(
        overrides={
            "model_name": "mixtral-tiny",
            "num_experts": num_experts,
            "num_experts_per_tok": k,
            "ragged_buffer_factor": buffer_factor,
        }
    )
    # Row code: (source shard, token, slot); the received expert is checked via the sort.
    x_PND = np.zeros((EP, n, 3), np.float32)
    x_PND[:, :, 0] = np.arange(EP)[:, None]
    x_PND[:, :, 1] = np.arange(n)[None, :]

    def body(x, experts):
        x, experts = x[0], experts[0]
        recv, plan, order = ep.sort_and_send(x, experts, c, "padded")
        sorted_rows, local_order, sizes = ep.sort_by_local_expert(recv, plan.recv_counts_PX)
        block = exchange.padded_block_rows(c, n, EP, recv.shape[0])
        unsorted = ep.rows.gather_rows(sorted_rows, local_order.dst_M, local_order.total)
        back = ep.send_back(unsorted, plan, order.shape[0], "padded", block)
        rows, _, _ = ep.dispatch.permute(x, experts, c.num_experts)
        return back[None], rows[None], sizes[None], plan.dropped[None]

    spec = P("expert")
    fn = jax.jit(
        jax.shard_map(body, mesh=expert_mesh(), in_specs=(spec, spec), out_specs=(spec,) * 4)
    )
    return [np.asarray(a) for a in fn(x_PND, experts_PNK.astype(np.int32))]


def test_roundtrip_exact_uniform_and_skewed():
    rng = np.random.default_rng(0)
    n, k, e = 6, 2, 16
    uniform = np.stack(
        [np.stack([rng.choice(e, k, replace=False) for _ in range(n)]) for _ in range(EP)]
    )
    skewed = np.tile(np.array([0, 1]), (EP, n, 1))  # every row to experts 0 and 1 (shard 0)
    # The skewed pairs' chunks (n * k rows each) are longer than one round's block: two rounds.
    c = load_config(
        overrides={"model_name": "mixtral-tiny", "num_experts": e, "num_experts_per_tok": k}
    )
    assert exchange.padded_block_rows(c, n, EP, EP * n * k) < n * k
    for experts in (uniform, skewed):
        back, rows, sizes, dropped = _plan_roundtrip(experts)
        np.testing.assert_array_equal(back, rows)  # bitwise: rows come home unchanged
        assert dropped.max() == 0
        counts = np.bincount(experts.reshape(-1), minlength=e).reshape(EP, e // EP)
        np.testing.assert_array_equal(sizes, counts)  # each shard got exactly its experts' rows
    _, _, sizes, _ = _plan_roundtrip(skewed)
    assert sizes[1:].sum() == 0 and sizes[0, 0] == EP * n  # no rows to shards 1..7


def test_roundtrip_all_rows_to_one_expert_with_capped_buffer_counts_drops():
    n, k = 6, 1
    experts = np.zeros((EP, n, k))  # all rows to expert 0 on shard 0
    back, rows, sizes, dropped = _plan_roundtrip(experts, buffer_factor=2.0)
    cap = 2 * n * k  # the receive buffer of shard 0 holds 2 sources' rows
    assert sizes[0, 0] == cap
    assert dropped[0] == EP * n * k - cap and (dropped == dropped[0]).all()
    np.testing.assert_array_equal(back[:2], rows[:2])  # sources 0, 1 fit
    assert not back[2:].any()  # the rest was dropped, returned as zeros, and counted


# --------------------------------------------------------------------------------------------
# The MoE layer under meshes vs no mesh: outputs, gradients, global stats.

LAYOUTS = {
    "a2a-ep8": ["ici_expert_parallelism=8", "ici_fsdp_parallelism=1"],
    "a2a-ep4-fsdp2-expfsdp": [
        "ici_expert_parallelism=4",
        "ici_fsdp_parallelism=2",
        "shard_exp_on_fsdp=true",
    ],
    "ring-ep2-tp2-data2": [
        "ici_expert_parallelism=2",
        "ici_fsdp_parallelism=1",
        "ici_tensor_parallelism=2",
        "ici_data_parallelism=2",
        "use_ring_of_experts=true",
    ],
    "a2a-eptp-ep4-data2": [
        "ici_expert_parallelism=4",
        "ici_fsdp_parallelism=1",
        "ici_data_parallelism=2",
        "sharding_rules=ep-tp",
    ],
    "ring-eptp-ep4-data2": [
        "ici_expert_parallelism=4",
        "ici_fsdp_parallelism=1",
        "ici_data_parallelism=2",
        "sharding_rules=ep-tp",
        "use_ring_of_experts=true",
    ],
    # The a2a dispatch on this mesh with GPT-OSS's routing and expert biases (the bias of the
    # TP-split F dimension included); DeepSeek's routing runs a2a on ep8 and ep4-fsdp2, and
    # on this mesh as a ring, so a second a2a program here would add a compile, no coverage.
    "a2a-ep2-tp2-data2-gptoss": [
        "ici_expert_parallelism=2",
        "ici_fsdp_parallelism=1",
        "ici_tensor_parallelism=2",
        "ici_data_parallelism=2",
        "moe_expert_bias=true",
        "router_logit_bias=true",
        "routed_score_func=softmax",
        "routed_bias=false",
        "n_routing_groups=-1",
        "topk_routing_group=-1",
    ],
}


def _layer_case(overrides):
    # the case's keys replace these defaults (a key given twice is refused)
    keys = {"model_name": "deepseek3-tiny", "per_device_batch_size": "1"}
    keys |= {"max_target_length": "8", "load_balance_loss_weight": "0.01"}
    keys |= dict(o.split("=", 1) for o in overrides)
    c = load_config(overrides=[f"{k}={v}" for k, v in keys.items()])
    p = param.initialize(layer.spec(c), jax.random.key(0), jnp.float32)
    bias = 0.1 * jax.random.normal(jax.random.key(2), (c.num_experts,))
    if c.moe_expert_bias:  # GPT-OSS: trained router and expert biases, random
        p = with_random_biases(p)
    else:
        p = dataclasses.replace(p, router=router.Router(p.router.w, bias))
    x = jax.random.normal(jax.random.key(1), (8, c.max_target_length, c.base_emb_dim))
    return c, p, x


def _loss(p, x, c):
    y, st, _ = layer.apply(p, x, c, jnp.float32)
    return jnp.sum(jnp.sin(y)) + st.lb_loss, (y, st)


def _run(c, p, x, mesh=None):
    f = jax.jit(jax.value_and_grad(_loss, has_aux=True), static_argnums=2)
    if mesh is None:
        return f(p, x, c)
    with jax.set_mesh(mesh), use_rules(config_rules(c)):
        sh = param.shardings(layer.spec(c), mesh, config_rules(c))
        return f(jax.device_put(p, sh), x, c)


def _same_layer_run(got, want):
    """Two `_run` results agree: outputs, loss, gradients, exact loads, lb loss, no drops.
    Returns `got`'s stats."""
    (l1, (y1, s1)), g1 = got
    (l0, (y0, s0)), g0 = want
    _close(y1, y0)
    _close(l1, l0)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        _close(a, b)
    np.testing.assert_array_equal(np.asarray(s1.load_E), np.asarray(s0.load_E))
    _close(s1.lb_loss, s0.lb_loss)
    assert int(s1.dropped) == int(s0.dropped) == 0
    return s1


def _close(a, b):
    """float32 table tolerance, atol relative to the array's scale (sums of many terms)."""
    a, b = np.asarray(a), np.asarray(b)
    t = tol(jnp.float32)
    np.testing.assert_allclose(a, b, rtol=t["rtol"], atol=t["atol"] * max(np.abs(b).max(), 1.0))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layer_forward_gradients_and_stats_match_no_mesh(name):
    c, p, x = _layer_case(LAYOUTS[name])
    s1 = _same_layer_run(_run(c, p, x, make_mesh(c)), _run(c, p, x))
    # The stats are replicated (out_specs P()): every shard holds the same value.
    shards = [np.asarray(s.data) for s in s1.load_E.addressable_shards]
    assert all((sh == shards[0]).all() for sh in shards)


def test_negative_control_swapped_expert_shards_fail():
    c, p, x = _layer_case(LAYOUTS["a2a-ep8"])
    (_, (y0, _)), _ = _run(c, p, x)
    x_local = c.num_experts // 8
    swapped = dataclasses.replace(p, wi_0=jnp.roll(p.wi_0, x_local, axis=0))
    (_, (y1, _)), _ = _run(c, swapped, x, make_mesh(c))
    with pytest.raises(AssertionError):
        _close(y1, y0)


def test_capped_buffer_counts_dropped_rows():
    c, p, x = _layer_case([*LAYOUTS["a2a-ep8"], "ragged_buffer_factor=0.5"])
    (_, (y1, s1)), _ = _run(c, p, x, make_mesh(c))
    # numpy model: shard s routes batch row s; a receiver keeps the first M rows by source.
    routing = router.route(p.router, x.reshape(-1, x.shape[-1]), c)
    experts = np.asarray(routing.experts_NK).reshape(8, -1)
    counts = np.stack([np.bincount(e, minlength=c.num_experts) for e in experts])  # [src, E]
    m = int(np.ceil(0.5 * experts.shape[1]))
    per_dst = counts.reshape(8, 8, -1).sum(-1)  # [src, dst]
    kept = sum(min(m, int(col.sum())) for col in per_dst.T)
    assert float(s1.dropped) == experts.size - kept > 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ragged_buffer_factor=0"], "ragged_buffer_factor=0"),
        (["ragged_buffer_factor=2", "use_ring_of_experts=true"], "does not apply"),
        (["use_ring_of_experts=true", "sparse_matmul=false"], "use_ring_of_experts=true"),
        (["a2a_impl=native"], "a2a_impl"),
    ],
)
def test_bad_ep_configs_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["model_name=mixtral-tiny", *overrides])


def test_ragged_impl_traces_and_lowers_with_gradients():
    """a2a_impl=ragged: forward and transpose lower to ragged-all-to-all (XLA:CPU cannot compile
    it, so this checks the program, not the numbers; the padded twin is checked above)."""
    c, p, x = _layer_case([*LAYOUTS["a2a-ep8"], "a2a_impl=ragged"])
    mesh = make_mesh(c)
    f = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    with jax.set_mesh(mesh), use_rules(config_rules(c)):
        text = f.lower(p, x, c).as_text()
    # the rows, their routing weights (the fused routed FFN weights them on the expert side)
    # and the return, each forward and transposed
    assert text.count("ragged_all_to_all") == 6


def _row_exchanges(overrides, remat: bool) -> int:
    """All-to-all instructions moving D-wide rows in the compiled forward+backward of the
    a2a-ep8 layer (padded: one per exchange, in its loop), optionally under a full-remat
    checkpoint (nothing saved: the backward pass replays what it needs of the forward)."""
    c, p, x = _layer_case([*LAYOUTS["a2a-ep8"], *overrides])

    def loss(p, x, c):
        fn = lambda p, x: layer.apply(p, x, c, jnp.float32)[:2]  # noqa: E731
        if remat:
            fn = jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
        y, st = fn(p, x)
        return jnp.sum(jnp.sin(y)) + st.lb_loss

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    with jax.set_mesh(make_mesh(c)), use_rules(config_rules(c)):
        text = f.lower(p, x, c).compile().as_text()
    d = c.base_emb_dim
    return sum(1 for line in text.splitlines() if " all-to-all(" in line and f",{d}]" in line)


@pytest.mark.default_codegen
def test_remat_replays_the_dispatch_but_not_the_expert_ffn_and_return():
    """With the routing weights applied on the expert side (the fused routed FFN), the home
    combine's backward needs no returned rows: under full remat the backward pass replays the
    dispatch (the FFN's input rows) but not the FFN's forward and the return exchange. The
    separate path weights at home, so its backward replays the return too (negative
    control)."""
    plain = _row_exchanges([], remat=False)  # send, return and both transposed
    assert plain == 4
    assert _row_exchanges([], remat=True) == plain + 1
    assert _row_exchanges(["moe_fused_routed_ffn=false"], remat=True) == plain + 2


# ---------------------------------------------------------------------------------------------
# num_moe_token_chunks inside the shard_map (expert=4 x fsdp=2), and activations in `dtype`.

CHUNKED = ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "max_target_length=16"]
ROUTING_MODELS = {"deepseek": "model_name=deepseek3-tiny", "mixtral": "model_name=mixtral-tiny"}


# a2a with deepseek's routing and the ring with mixtral's by default, the other two on demand:
# routing happens upstream of the chunk loop, so each strategy's default case covers its other one
_CHUNKS = "tests/distributed/test_ep.py::test_token_chunks_match_one_chunk_on_the_mesh"


@pytest.mark.parametrize(
    "strategy, routing",
    [
        ("a2a", "deepseek"),
        ("ring", "mixtral"),
        pytest.param(
            "a2a",
            "mixtral",
            marks=[pytest.mark.full_grid, pytest.mark.covered_by(f"{_CHUNKS}[a2a-deepseek]")],
        ),
        pytest.param(
            "ring",
            "deepseek",
            marks=[pytest.mark.full_grid, pytest.mark.covered_by(f"{_CHUNKS}[ring-mixtral]")],
        ),
    ],
)
def test_token_chunks_match_one_chunk_on_the_mesh(strategy, routing):
    ring = [f"use_ring_of_experts={strategy == 'ring'}"]
    base = [*CHUNKED, *ring, ROUTING_MODELS[routing]]
    c1, p, x = _layer_case(base)
    c4, _, _ = _layer_case([*base, "num_moe_token_chunks=4"])
    x = jax.random.normal(jax.random.key(1), (8, 16, c1.base_emb_dim))
    one = _run(c1, p, x, make_mesh(c1))
    _same_layer_run(_run(c4, p, x, make_mesh(c4)), one)
    y1 = one[0][1][0]
    # negative control: one perturbed expert weight fails the same comparison
    bad = dataclasses.replace(p, wo=p.wo.at[5].multiply(1.01))
    (_, (y_bad, _)), _ = _run(c4, bad, x, make_mesh(c4))
    with pytest.raises(AssertionError):
        _close(y_bad, y1)


def _compiled_bf16(overrides):
    """(config, lowered StableHLO text, compiled HLO text) of the layer's value and gradients,
    dtype=bfloat16 (N = 32 tokens per shard)."""
    c, p, _ = _layer_case(
        [
            *CHUNKED,
            "max_target_length=32",
            "dtype=bfloat16",
            "base_moe_mlp_dim=96",  # F != D, so no weight shape looks like a row buffer
            "gmm_tile_rows=16",  # gmm's float32 tile products stay smaller than the buffers
            *overrides,
        ]
    )
    dtype = jnp.dtype(c.dtype)
    x = jax.random.normal(jax.random.key(1), (8, 32, c.base_emb_dim), dtype)

    def loss(p, x):
        y, st, _ = layer.apply(p, x, c, dtype)
        return jnp.sum(y.astype(jnp.float32)) + st.lb_loss

    mesh = make_mesh(c)
    with jax.set_mesh(mesh), use_rules(config_rules(c)):
        sh = param.shardings(layer.spec(c), mesh, config_rules(c))
        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        lowered = f.lower(jax.device_put(p, sh), x)
        return c, lowered.as_text(), lowered.compile().as_text()


def _shapes(text, op):
    """(dtype, dims) of the results of every `op` instruction in compiled HLO text."""
    pattern = rf"= \(?((?:[a-z0-9]+\[[0-9,]*\][^ ]*,? ?)+)\)? {op}\("
    out = set()
    for group in re.findall(pattern, text):
        for dt, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", group):
            out.add((dt, tuple(int(v) for v in dims.split(",") if v)))
    return out


@pytest.mark.extended  # 47 s: CI's extended run
def test_chunk_buffers_in_compiled_hlo_are_one_chunks_worst_case():
    """a2a (padded, on CPU): per-peer blocks of one round (`exchange.padded_block_rows`: twice the
    mean a peer gets, N*K/P) and the receive buffer of M = P*N*min(K, X) rows are a quarter
    with 4 chunks; ring: gathered tokens [P*N, D], the routed rows' ids [M] and, when kept,
    their gate and up [M, F] too.
    (XLA:CPU splits the all-to-all per peer, [1, block, D], and runs bfloat16 collectives in
    float32, so the collectives' shapes are compared without their dtype.)"""
    c1, _, hlo1 = _compiled_bf16([])
    _, _, hlo4 = _compiled_bf16(["num_moe_token_chunks=4"])
    d, p, n = c1.base_emb_dim, 4, 32
    k_x = min(c1.num_experts_per_tok, c1.num_experts // p)
    blocks1 = {s for _, s in _shapes(hlo1, "all-to-all") if len(s) == 3}
    blocks4 = {s for _, s in _shapes(hlo4, "all-to-all") if len(s) == 3}
    m1, m4 = p * n * k_x, p * n * k_x // 4  # receive buffer rows
    block1, block4 = (
        exchange.padded_block_rows(c1, n, p, m1),
        exchange.padded_block_rows(c1, n // 4, p, m4),
    )
    assert block1 == 2 * n * c1.num_experts_per_tok // p and block4 == block1 // 4
    # the rows' blocks and their routing weights' ([1, block, 1])
    assert blocks1 == {(1, block1, d), (1, block1, 1)}, blocks1
    assert blocks4 == {(1, block4, d), (1, block4, 1)}, blocks4
    assert f"bf16[{m1},{d}]" in hlo1 and f"[{m1},{d}]" not in hlo4
    assert f"bf16[{m4},{d}]" in hlo4
    _, _, ring1 = _compiled_bf16(["use_ring_of_experts=true"])
    _, _, ring4 = _compiled_bf16(["use_ring_of_experts=true", "num_moe_token_chunks=4"])
    gathered1 = {s for _, s in _shapes(ring1, "all-gather")}
    gathered4 = {s for _, s in _shapes(ring4, "all-gather")}
    assert (p * n, d) in gathered1 and (p * n, d) not in gathered4
    assert (p * n // 4, d) in gathered4
    rows1, rows4 = p * n * c1.num_experts_per_tok, p * n * c1.num_experts_per_tok // 4
    # the routed rows' token ids (ep.select_local; routed.py makes no [rows, D] buffer, and no
    # [rows, F] one when gate and up are recomputed, the default remat policy)
    assert f"s32[{rows1}]" in ring1 and f"s32[{rows1}]" not in ring4
    assert f"s32[{rows4}]" in ring4
    # with gate and up kept (remat_policy=none), their [rows, F] residuals are chunked too
    f = c1.base_moe_mlp_dim
    _, _, kept1 = _compiled_bf16(["use_ring_of_experts=true", "remat_policy=none"])
    _, _, kept4 = _compiled_bf16(
        ["use_ring_of_experts=true", "num_moe_token_chunks=4", "remat_policy=none"]
    )
    assert f"bf16[{rows1},{f}]" in kept1 and f"[{rows1},{f}]" not in kept4
    assert f"bf16[{rows4},{f}]" in kept4


def _f32_row_arrays(stablehlo: str, d: int, rows: set[int]) -> list[str]:
    """float32 tensors [..., r, ..., D] with r one of `rows` in lowered StableHLO text."""
    found = set(re.findall(r"tensor<([0-9x]+)xf32>", stablehlo))
    return sorted(
        s for s in found if s.endswith(f"x{d}") and any(f"x{r}x" in f"x{s}" for r in rows)
    )


@pytest.mark.parametrize("strategy", ["a2a", "ring", "ring-kept"])
def test_rows_stay_in_bfloat16_through_dispatch_exchange_and_combine(strategy):
    """The program we emit (StableHLO, forward and backward) has no float32 array of a row
    buffer's shape: sorted N*K rows, receive buffer, per-peer blocks, gathered rows. float32
    only in the [N, D] combine accumulator (float32_weight_sum=true) and gmm's tile products.
    `ring-kept`: gate and up kept as residuals (remat_policy=none), in bfloat16."""
    kept = ["remat_policy=none"] if strategy == "ring-kept" else []
    c, text, _ = _compiled_bf16([f"use_ring_of_experts={strategy != 'a2a'}", *kept])
    d, p, n, k = c.base_emb_dim, 4, 32, c.num_experts_per_tok
    k_x = min(k, c.num_experts // p)
    if strategy == "a2a":
        block = exchange.padded_block_rows(c, n, p, p * n * k_x)
        rows = {n * k, p * n * k_x, block}  # sorted rows, receive buffer, per-peer block
    else:
        rows = {p * n * k}  # the gathered tokens' sorted rows
    # (ring: [P*N, D] float32 is the combine accumulator over the gathered tokens; the gathered
    # tokens themselves are checked on the all-gathers below)
    assert not _f32_row_arrays(text, d, rows)
    gathers = [line for line in text.splitlines() if "all_gather" in line]
    assert not [g for g in gathers if re.search(rf"x{d}xf32>", g)]
    if strategy == "a2a":
        assert f"tensor<{p * n * k_x}x{d}xbf16>" in text
    else:  # the routed rows exist only as tiles (routed.py), or as their kept gate and up
        gate_up = f"tensor<{p * n * k}x{c.base_moe_mlp_dim}x"
        assert (gate_up + "bf16>" in text) == bool(kept)
        assert gate_up + "f32>" not in text


def test_negative_control_float32_rows_are_seen():
    """dtype=float32 moves float32 rows: the same check finds them."""
    c, text, _ = _compiled_bf16(["dtype=float32"])
    d, p, n = c.base_emb_dim, 4, 32
    k_x = min(c.num_experts_per_tok, c.num_experts // p)
    assert f"{p * n * k_x}x{d}" in " ".join(_f32_row_arrays(text, d, {p * n * k_x}))


def test_chunks_must_divide_the_tokens_per_batch_shard():
    c = load_config(overrides=["model_name=deepseek3-tiny", *CHUNKED, "num_moe_token_chunks=3"])
    with pytest.raises(ConfigError, match="num_moe_token_chunks=3 does not divide the 32 tokens"):
        make_mesh(c)
