"""The figures the step-time model uses, one table per chip, each with its source.

Peaks (bfloat16 dense FLOP/s, HBM bytes/s) are `targets.CHIPS`'; this table adds the fp8
peak, the links and the shares of a peak real code reaches. "Nominal" figures are vendors';
"achieved" shares are read from published measurements (named per entry); "assumed" ones are
ours, stated so a reader can change them in one place.

Links, per chip, one direction:
- TPU: every ICI link of the torus (v5p: 3-D, 6 links per chip; v5e/v6e: 2-D, 4 links);
- GPU: the NVLink bandwidth to the NVSwitch (all 8 GPUs of a node at full rate each) and the
  GPU's one network card across nodes.
"""

from __future__ import annotations

import dataclasses

from expertax import targets


@dataclasses.dataclass(frozen=True)
class Links:
    chip: str  # targets.CHIPS key
    fp8_flops: float  # dense fp8 peak per chip; the bf16 peak where the chip has no fp8 unit
    ici_bytes_per_s: float = 0.0  # TPU: per link, one direction
    nvlink_bytes_per_s: float = 0.0  # GPU: per GPU, one direction
    nic_bytes_per_s: float = 0.0  # GPU: per GPU, one direction, across nodes
    link_share: float = 1.0  # the share of a link's nominal rate collectives reach (achieved)
    nic_share: float = 1.0
    allreduce_bytes_per_s: float = 0.0  # GPU: a full node's all-reduce bus rate (NVLink SHARP)
    latency_s: float = 10e-6  # per collective, inside a node or slice (assumed)
    network_latency_s: float = 25e-6  # per collective across nodes (assumed)
    matmul_share: float = 0.8  # of the peak, a large GEMM (achieved)
    memory_share: float = 0.85  # of the HBM rate, a streaming fusion (assumed)
    tile: tuple[int, int, int] = (128, 128, 128)  # (rows, contraction, columns) a GEMM pads to
    sources: tuple[str, ...] = ()

    @property
    def peak(self) -> float:
        return targets.CHIPS[self.chip].peak_bf16_flops

    @property
    def hbm(self) -> float:
        return targets.CHIPS[self.chip].hbm_bytes_per_s


_SCALING_BOOK = "How to Scale Your Model (jax-ml.github.io/scaling-book), 'TPUs' part, link table"
_H100 = (
    "NVIDIA H100 SXM data sheet: 989 TF/s bf16 and 1,979 TF/s fp8 dense, NVLink 900 GB/s "
    "(both directions: 18 links x 25 GB/s each way), 3.35 TB/s HBM3",
    "DGX H100: one ConnectX-7 400 Gb/s (50 GB/s) InfiniBand card per GPU",
    "NVIDIA/nccl-tests#212 (maintainer): 8 x H100 reach ~370 GB/s bus bandwidth in collectives "
    "other than all-reduce (NVLink's 450 less protocol overhead) and ~480 GB/s in all-reduce "
    "with NVLink SHARP: link_share 370/450, allreduce 480",
    "NVIDIA/nccl-tests#290, #267 (maintainers): 46-49 GB/s per 400 Gb/s card: nic_share 0.9",
)


def _tpu(chip: str, ici: float, tile: tuple[int, int, int], source: str) -> Links:
    """A TPU's entry: no fp8 unit (fp8 GEMMs at the bf16 rate), ICI per link one way; the
    achieved shares are assumed (no published per-link measurement for these chips)."""
    peak = targets.CHIPS[chip].peak_bf16_flops
    return Links(
        chip,
        fp8_flops=peak,
        ici_bytes_per_s=ici,
        link_share=0.85,
        latency_s=5e-6,
        matmul_share=0.85,
        tile=tile,
        sources=(
            f"{_SCALING_BOOK}: {source}",
            "scaling book, 'Sharding', pop quiz 2: an all-gather of 32 kB shards over 4 v5e chips "
            "measured ~8 us (3 hops of ~1 us each plus start-up): latency 5 us per collective",
        ),
    )


LINKS = {
    "v5p": _tpu("v5p", 90e9, (8, 128, 128), "v5p ICI 9e10 bytes/s one way per link, 3-D torus"),
    "v5e": _tpu("v5e", 45e9, (8, 128, 128), "v5e ICI 4.5e10 bytes/s one way per link, 2-D torus"),
    "v6e": _tpu("v6e", 90e9, (8, 256, 256), "v6e ICI 9e10 bytes/s one way per link, 2-D torus"),
    "h100": Links(
        "h100",
        fp8_flops=1979e12,
        nvlink_bytes_per_s=450e9,
        nic_bytes_per_s=50e9,
        link_share=370 / 450,
        nic_share=0.9,
        allreduce_bytes_per_s=480e9,
        latency_s=15e-6,
        matmul_share=0.75,
        tile=(128, 64, 128),
        sources=_H100,
    ),
}
LINKS["h200"] = dataclasses.replace(
    LINKS["h100"],
    chip="h200",
    sources=(*_H100, "H200 SXM: the H100's compute and links with 4.8 TB/s HBM3e"),
)


def torus_wraps(chip: str, torus: tuple[int, ...]) -> tuple[bool, ...]:
    """Which axes of a TPU slice's chip grid close into a ring. v5p: a slice made of whole
    4x4x4 cubes has wraparound on every axis (the optical switches of a cube provide it), a
    smaller one on none; v5e/v6e: an axis of 16 chips wraps, a shorter one does not (scaling
    book, "TPUs" part; Cloud TPU's v5p page)."""
    if chip == "v5p":
        whole = all(n % 4 == 0 for n in torus)
        return tuple(whole for _ in torus)
    return tuple(n == 16 for n in torus)
