"""What the fit search tries for the saved activations, and what each choice recomputes.

A remat choice is a preset (`remat_policy=full`, `minimal`, ...) or a custom per-name placement
(`remat_policy=custom decoder_layer_input=offload ...`). The custom ones the search builds are
ladders over the names a config's stacks can keep (`remat.names_kept`), in the order their
bytes pay for the recompute they save (seeds/3414: the layer input first, then the attention
outputs, then the MoE hiddens):

    tier 1: decoder_layer_input           the scan carry, [B, T, D] per layer
    tier 2: out_proj                      the attention block's output projection, [B, T, D]
    tier 3: the attention projections     q/k/v, MLA's latents and up-projections, its output
    tier 4: moe_mlpwo, mlpwi_0, mlpwi_1   the expert outputs, the dense/shared MLP hiddens
    tier 5: moe_mlpwi_0, moe_mlpwi_1      the routed experts' gate and up, [rows, F]

`offload-k` places tiers 1..k in pinned host memory; `input+device-k` offloads the layer input
and keeps tiers 2..k on device. Each ladder step keeps more and recomputes less
(`recompute_share`), so the search can trade host bytes and transfers for recompute. With
`moe_paged_stash` the MoE stack keeps only its layer input and the stashed names (the routed
experts' outputs in one buffer by real rows, nn/moe/stash.py).
"""

from __future__ import annotations

import dataclasses

from expertax.config.schema import Config
from expertax.parallel import remat

TIERS: tuple[tuple[str, ...], ...] = (
    (remat.DECODER_LAYER_INPUT,),
    (remat.OUT_PROJ,),
    (
        remat.QUERY_WA_PROJ,
        remat.KV_WA_PROJ,
        remat.MLA_Q,
        remat.MLA_KV,
        remat.QUERY_PROJ,
        remat.KEY_PROJ,
        remat.VALUE_PROJ,
        remat.ATTENTION_OUT,
    ),
    (remat.MOE_MLPWO, remat.MLPWI_0, remat.MLPWI_1),
    (remat.MOE_MLPWI_0, remat.MOE_MLPWI_1),
)

# The parts of a layer's forward (space.flops_per_token) and, for each, the names whose saving
# spares its recompute in the backward pass (all of them must be kept, on device or host).
PART_NAMES: dict[str, tuple[str, ...]] = {
    "qkv": (remat.QUERY_PROJ, remat.KEY_PROJ, remat.VALUE_PROJ, remat.MLA_Q, remat.MLA_KV),
    "kernel": (remat.ATTENTION_OUT,),
    "out": (remat.OUT_PROJ,),
    "ffn_in": (remat.MOE_MLPWI_0, remat.MOE_MLPWI_1, remat.MLPWI_0, remat.MLPWI_1),
    "ffn_out": (remat.MOE_MLPWO,),
}


@dataclasses.dataclass(frozen=True)
class RematChoice:
    """One remat option of the search: a preset or a custom placement, with its config keys."""

    label: str  # "full", "offload-2", "input+device-3", "stash+offload-1", ...
    overrides: tuple[tuple[str, object], ...]

    @property
    def as_dict(self) -> dict[str, object]:
        return dict(self.overrides)

    def placements(self) -> dict[str, str]:
        o = self.as_dict
        custom = {n: str(o[n]) for n in remat.ALL_NAMES if n in o}
        return remat.placements(str(o["remat_policy"]), custom)

    @property
    def offloads(self) -> bool:
        return remat.OFFLOAD in self.placements().values()

    def offloads_any(self, names) -> bool:
        place = self.placements()
        return any(place[n] == remat.OFFLOAD for n in names)


def _custom(label: str, place: dict[str, str], **extra) -> RematChoice:
    keys = {"remat_policy": "custom", **{n: place.get(n, remat.REMAT) for n in remat.ALL_NAMES}}
    return RematChoice(label, tuple({**keys, **extra}.items()))


def ladders(c: Config, *, offload: bool, stash: bool) -> list[RematChoice]:
    """The custom placements of the search for `c` (module docstring), the names no stack of
    `c` keeps left out; offloading ones only with `offload` (pinned host memory), stash ones
    only with `stash` (a sparse MoE config the stash can run)."""
    kept = {n for names in remat.names_kept(c).values() for n in names}
    tiers = [tuple(n for n in tier if n in kept) for tier in TIERS]
    tiers = [t for t in tiers if t]
    out: list[RematChoice] = []
    for k in range(1, len(tiers) + 1):
        names = [n for tier in tiers[:k] for n in tier]
        if offload:
            out.append(_custom(f"offload-{k}", dict.fromkeys(names, remat.OFFLOAD)))
        if offload and k > 1:
            place = dict.fromkeys(names, remat.DEVICE) | {remat.DECODER_LAYER_INPUT: remat.OFFLOAD}
            out.append(_custom(f"input+device-{k}", place))
    if stash:
        expert_out = {remat.MOE_MLPWO: remat.DEVICE}
        every = dict.fromkeys(remat.STASHABLE, remat.DEVICE)
        for label, kept_names in (("out", expert_out), ("all", every)):
            out.append(_custom(f"stash-{label}", kept_names, moe_paged_stash=True))
            if offload:
                place = kept_names | {remat.DECODER_LAYER_INPUT: remat.OFFLOAD}
                out.append(_custom(f"stash-{label}+input-offload", place, moe_paged_stash=True))
    return out


def presets(names: list[str]) -> list[RematChoice]:
    return [RematChoice(p, (("remat_policy", p),)) for p in names]


def recomputed_parts(place: dict[str, str], kept: set[str] | list[str]) -> set[str]:
    """The parts of a layer's forward its backward pass recomputes under `place`, for a stack
    that keeps the names `kept` (`remat.names_kept(c)[stack]`): a part is spared when every
    name of it the stack keeps is saved (on device or host)."""
    if all(p != remat.REMAT for p in place.values()):
        return set()  # remat_policy=none: nothing recomputed
    out = set()
    for part, names in PART_NAMES.items():
        relevant = [n for n in names if n in kept]
        # A part whose output the stack never keeps is never read by the backward pass (the
        # dense MLP's output only feeds the residual add): nothing to recompute.
        if relevant and any(place.get(n, remat.REMAT) == remat.REMAT for n in relevant):
            out.add(part)
    if "qkv" in out:  # the kernel's backward needs q, k and v: recomputing them replays it
        out.add("kernel")
    return out
