"""The routing probe of `expertax parity`: which experts each layout's routers choose at the
first step, and the first step's loss with the reference's choices imposed.

A top-k selection is discontinuous: two experts whose selection scores differ by less than the
float32 rounding of a layout (a partial sum over tensor shards added in another order, a matmul
blocked differently) swap places, and one flipped (token, slot) moves the loss by far more than
rounding. The probe runs the forward pass of the first batch under a layout with
`decoder.forward(..., imposed_LBTK)`: with nothing imposed (every entry -1) it returns the
experts the layout's routers chose, layer by layer; with the reference run's choices imposed,
every layer uses the reference's experts (their weights still computed by the layout's own
routers), so the loss compares the layout's numerics without flips. One program serves both (the
imposed selection is an input), compiled once per layout, beside and apart from the train step.

The probe runs the layout's mesh and dispatch; a stash layout is probed without the stash (it
changes what the backward pass keeps, not the forward pass); a pipelined layout is not probed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from expertax.config.schema import Config
from expertax.models import decoder
from expertax.nn import vocab_loss
from expertax.nn.attention import context
from expertax.train.trainer import build_trainer


def probe_loss(params, batch: dict, imposed_LBTK, c: Config):
    """The first step's cross-entropy (the train step's `loss`) and the routers' own choices
    [L_moe, B, T, K] under `imposed_LBTK` (-1: the router's own choice). Under a
    load-balanced context axis the batch and the imposed routing are reordered as the train step
    reorders them (nn/attention/context.py), and the choices come back in sequence order."""
    balanced = context.balance(batch, c)
    reordered = balanced is not batch
    if reordered:
        batch = balanced
        imposed_LBTK = context.reorder(imposed_LBTK, context.size(), axis=2)
    logits_BTV, stats = decoder.forward(
        params,
        batch["inputs"],
        c,
        positions_BT=batch.get("positions"),
        segment_ids_BT=batch.get("segment_ids"),
        imposed_LBTK=imposed_LBTK,
    )
    if stats is None:
        raise ValueError("the routing probe needs a model with MoE layers")
    w_BT = batch["weights"].astype(jnp.float32)
    ce = vocab_loss.nll_sum(logits_BTV, batch["targets"], w_BT) / jnp.maximum(jnp.sum(w_BT), 1.0)
    chosen = stats.chosen_BTK
    if reordered:
        chosen = context.reorder(chosen, context.size(), axis=2, inverse=True)
    return ce, chosen


def probed(c: Config) -> bool:
    """Whether the probe can run `c`: an MoE model that is not pipelined (a stash is turned off
    by `probe` itself)."""
    return c.is_moe and c.pipelined_layers == 0


def probe(c: Config, devices, batch: dict, imposed: list[np.ndarray | None]) -> list[dict]:
    """Run the probe of `c` on `devices` (its mesh) once per entry of `imposed` (int32 [L_moe, B,
    T, K] routings, or None for the routers' own): per entry {"loss", "chosen"} (host values)."""
    c = c.model_copy(update={"moe_paged_stash": False})
    trainer = build_trainer(c, devices=devices)
    params = trainer.init_state().params
    spec = PartitionSpec(None, *trainer.batch_sharding.spec)
    imposed_sharding = NamedSharding(trainer.mesh, spec)
    shape = (c.num_moe_layers, trainer.global_batch, c.max_target_length, c.num_experts_per_tok)
    fn = jax.jit(lambda p, b, r: probe_loss(p, b, r, c))
    out = []
    with trainer.context():
        on_device = trainer.put_batch(batch)
        for routing in imposed:
            routing = np.full(shape, -1, np.int32) if routing is None else routing
            r = jax.device_put(np.asarray(routing, np.int32), imposed_sharding)
            loss, chosen = jax.device_get(fn(params, on_device, r))
            out.append({"loss": float(loss), "chosen": np.asarray(chosen)})
    return out


def count_flips(ref_LBTK: np.ndarray, got_LBTK: np.ndarray) -> list[int]:
    """Per layer, the (token, slot) routing decisions of the reference whose expert the layout did
    not choose for that token (the order of a token's K experts does not count: a swap within
    them changes no computation)."""
    if ref_LBTK.shape != got_LBTK.shape:
        raise ValueError(f"routing shapes differ: {ref_LBTK.shape} vs {got_LBTK.shape}")
    found = (ref_LBTK[..., :, None] == got_LBTK[..., None, :]).any(-1)  # [L, B, T, K]
    return [int(n) for n in (~found).reshape(found.shape[0], -1).sum(-1)]


def format_flips(flips: list[int] | None) -> str:
    """The flips column: `-` (not probed), `0`, or the total and the per-layer counts."""
    if flips is None:
        return "-"
    if not any(flips):
        return "0"
    return f"{sum(flips)} ({'/'.join(str(n) for n in flips)})"


def verdict(r: dict, bound: float) -> tuple[bool, str]:
    """(ok, the ok cell) of a row against `bound` (tolerance x the reference loss scale).

    A row within tolerance is ok, unless its imposed-routing |dloss| is not (a defect that a flip
    happened to offset). A row out of tolerance is ok only when routing flips explain it: the
    layout chose other experts than the reference for some (token, slot) at the first step and,
    with the reference's choices imposed, its first step's forward loss is within tolerance. The
    cell says what that covers: the first step's forward pass (the probe), not the backward pass
    or later steps, and for a stash layout the probe runs without the stash."""
    flips, imposed = r.get("routing_flips"), r.get("imposed_loss_diff")
    imposed_ok = imposed is None or imposed <= bound
    if r["max_abs_loss_diff"] <= bound:
        return (True, "yes") if imposed_ok else (False, "NO (imposed routing out of tolerance)")
    if not flips or not any(flips):
        return False, "NO"
    if imposed is None:
        return False, f"NO ({sum(flips)} routing flips; --impose-routing compares without them)"
    if imposed_ok:
        scope = "step 0's forward" + (", no stash" if r.get("stash") else "")
        return (
            True,
            f"yes ({sum(flips)} routing flips; within tolerance under the reference's "
            f"routing: {scope})",
        )
    return False, "NO (out of tolerance with the reference's routing imposed too)"
