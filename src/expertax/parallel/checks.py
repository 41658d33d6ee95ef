"""What the rematerialization names (remat.py) allow, checked before anything is traced: a
placement that some layer of this config saves, the paged stash's names, and host offload where
the chunked scans and the platform can take it. Field-against-field checks of the same keys are
the config's (config/checks/)."""

from __future__ import annotations

from expertax.config.schema import Config
from expertax.errors import ConfigError
from expertax.parallel import remat

# Platforms whose compilers hold host-offloaded residuals in a separate memory space (the planner
# reads it too).
OFFLOAD_PLATFORMS = ("gpu", "tpu")


def check_paged_stash(c: Config) -> None:
    if c.moe_paged_stash and not remat.stashed_names(c):
        raise ConfigError(
            f"moe_paged_stash=true but remat_policy={c.remat_policy} saves none of "
            f"{', '.join(remat.STASHABLE)} (all recomputed): nothing to stash; keep one of them "
            "(remat_policy=custom moe_mlpwo=device, or minimal) or set moe_paged_stash=false"
        )


def check_placements(c: Config) -> None:
    """A name placed on device or offload (remat_policy=custom) that no layer of this config
    saves is refused: the placement would do nothing (remat.py `unkept`). So is a per-name
    placement under a preset, which places every name itself; and an offloaded name under the
    paged stash, whose buffers are in device memory."""
    if c.remat_policy != "custom":
        fields = type(c).model_fields
        changed = [
            f"{n}={getattr(c, n)}" for n in remat.ALL_NAMES if getattr(c, n) != fields[n].default
        ]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)}: per-name placements are read only with "
                f"remat_policy=custom (remat_policy={c.remat_policy} places every name itself); "
                "add remat_policy=custom or leave them out"
            )
        return
    if c.moe_paged_stash:
        for name in remat.stashed_names(c):
            if getattr(c, name) == remat.OFFLOAD:
                raise ConfigError(
                    f"{name}=offload with moe_paged_stash=true: the stash keeps {name} in its "
                    f"device buffers, never in host memory; set {name}=device (stashed) or "
                    "moe_paged_stash=false"
                )
    unkept = remat.unkept(c)
    for name, place in remat.config_placements(c).items():
        if place != remat.REMAT and name in unkept:
            raise ConfigError(
                f"{name}={place}: no layer of {c.model_name} saves it: {unkept[name]}; "
                f"otherwise set {name}=remat"
            )


def check_query_chunk_offload(c: Config) -> None:
    """A name computed inside a query chunk (num_attention_token_chunks > 1) is saved by the
    chunk's own checkpoint, on device."""
    n = c.num_attention_token_chunks
    if n == 1:
        return
    offloaded = _offloaded(c, remat.QUERY_CHUNK_NAMES)
    if offloaded:
        raise ConfigError(
            f"num_attention_token_chunks={n} with {offloaded[0]}=offload: {offloaded[0]} is "
            "computed inside a query chunk, whose own checkpoint keeps what it saves on device; "
            f"set {offloaded[0]}=device or remat, or num_attention_token_chunks=1"
        )


def check_moe_chunk_offload(c: Config, platform: str) -> None:
    """Host offload of a MoE name inside MoE token chunks is refused on GPU and TPU, before
    anything is traced: each chunk's own checkpoint (nn/moe/chunks.scan_chunks) stacks what it
    offloads over the chunks inside the layers' scan, a host buffer neither compiler lays out
    (jax 0.10.2: XLA:GPU fails layout assignment, XLA:TPU its async slices). On a CPU, one memory,
    the offload is a placement only and compiles."""
    if platform not in OFFLOAD_PLATFORMS or c.num_moe_token_chunks == 1:
        return
    offloaded = _offloaded(c, remat.STASHABLE)
    if offloaded:
        raise ConfigError(
            f"num_moe_token_chunks={c.num_moe_token_chunks} with {offloaded[0]}=offload on "
            f"{platform.upper()}: the chunks' offloaded residuals do not compile there; set "
            f"{offloaded[0]}=device or remat, keep them in the paged stash "
            "(moe_paged_stash=true), or num_moe_token_chunks=1"
        )


def _offloaded(c: Config, names: tuple[str, ...]) -> list[str]:
    place = remat.config_placements(c)
    return [name for name in names if place[name] == remat.OFFLOAD]


CHECKS = (check_query_chunk_offload, check_paged_stash, check_placements)
