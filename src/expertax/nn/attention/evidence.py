"""What `attention_impl=auto` picks on each platform, and what that choice rests on: the attention
counterpart of `nn/moe/gmm.MEASURED` (docs/design/attention.md).

Each entry says whether its choice was measured (timed on that hardware) or only compiled. A
compile for a target gives the compiled program (its kernels), XLA's buffer assignment (the
temporaries) and the FLOPs that can be counted from its HLO; it gives no time. No entry below
says measured unless a time was taken on that platform.

`COMPILED_ROWS`: one attention call, forward+backward (gradients of q, k, v), B=1, T=4096,
bfloat16, causal, with packed-document segment ids, compiled for one chip of the target by
`benchmarks/attention_targets.py --hopper-head-dims` (JAX's cuDNN head-dim check answered as on
an H100 host) at 11de654: benchmarks/results/attention/targets-segments-2026-11-26.jsonl
(BENCHMARKS.md, "Attention on accelerator targets"). Cases:
`deepseek3` (MLA: H=G=128, q/k 192, v 128) and `mixtral` (GQA: H=32, G=8, 128). `counted_gflop`:
matmul FLOPs counted from the HLO, None where they are inside a kernel XLA cannot see into;
`model_gflop`: the matmul FLOPs of the tiles a causal kernel visits (a model of the code, not a
compiler figure; blockwise's loops have data-dependent trip counts the HLO count cannot read).
"""

from __future__ import annotations

import dataclasses

MEASURED = "measured"
COMPILED = "compiled, not run"
RAW_FILE = "targets-segments-2026-11-26.jsonl"  # under benchmarks/results/attention/


@dataclasses.dataclass(frozen=True)
class Compiled:
    case: str
    impl: str
    counted_gflop: float | None
    model_gflop: float | None
    temp_mib: float
    kernel: str  # custom-call target of the kernel in the program; "-" for none


@dataclasses.dataclass(frozen=True)
class Choice:
    """`auto` on one platform: `short` below kernel.AUTO_BLOCKWISE_MIN_LENGTH query positions,
    `long` from there; `kernel`, where set, at every length where it can run (cuDNN: dtype,
    head dims and cuDNN itself, `cudnn.unusable_because`)."""

    short: str
    long: str
    kernel: str | None
    basis: str  # MEASURED or COMPILED
    where: str
    date: str
    versions: str
    evidence: str
    compiled: tuple[Compiled, ...] = ()


_VERSIONS = "jax 0.10.2, jaxlib 0.10.2"

AUTO = {
    "cpu": Choice(
        short="dot",
        long="blockwise",
        kernel=None,
        basis=MEASURED,
        where="shared 2-core x86 CPU host (load average 7-9)",
        date="2026-11",
        versions=_VERSIONS,
        evidence="benchmarks/attention.py, deepseek3-small head dims, float32, fwd+bwd: "
        "blockwise/dot time 0.3-0.9 at T=512, 0.19 at T=4096 (dot 30 s and 3.1 GiB temps, "
        "blockwise 5.5 s and 0.18 GiB); see kernel.AUTO_BLOCKWISE_MIN_LENGTH",
    ),
    "gpu": Choice(
        short="dot",
        long="blockwise",
        kernel="cudnn",
        basis=COMPILED,
        where="gpu:h100x8 (one H100), compiled on a CPU machine without a GPU (no autotuning)",
        date="2026-11-26",
        versions=f"{_VERSIONS}, jax-cuda12-plugin 0.10.2, nvidia-cudnn-cu12 9.28.0.42",
        evidence="cuDNN's fused attention is the only program without a [T, S] buffer and "
        "with the fewest temporaries: DeepSeek-V3 dims 0.78 GiB (v padded to 192) against "
        "blockwise 1.37 GiB and dot 20 GiB; Mixtral 0.13 GiB against 0.22 and 5 GiB. Its FLOPs "
        "are inside the custom call (not counted). No time was taken: measure before trusting",
    ),
    "tpu": Choice(
        short="dot",
        long="splash",
        kernel=None,
        basis=COMPILED,
        where="tpu:v5p-8 (one v5p chip), compiled on a CPU machine by libtpu",
        date="2026-11-26",
        versions=f"{_VERSIONS}, libtpu 0.0.42.1",
        evidence="splash and blockwise both keep temporaries linear in T (DeepSeek-V3 dims "
        "1.37 against 1.41 GiB, Mixtral 0.09 against 0.12 GiB; dot 12.4 and 3.0 GiB); splash "
        "does about 1.3x blockwise's matmul FLOPs by the tile model (its dq and dkv kernels "
        "both recompute the scores), but its score tiles stay in the kernel's VMEM, while "
        "blockwise's compiled loop bodies write each float32 score tile ([G, J, 512, 512]: "
        "32 MiB for Mixtral, 128 MiB for DeepSeek-V3) to HBM as a fusion output and copy it "
        "back into VMEM, forward and backward. Chosen for that, not for a time: none was "
        "taken. Below 512 positions one tile covers the sequence: dot there",
    ),
}

COMPILED_ROWS = {
    "gpu": (
        Compiled("deepseek3", "dot", 3573.4, None, 20480.0, "-"),
        Compiled("deepseek3", "blockwise", None, 2783.1, 1404.8, "-"),
        Compiled("deepseek3", "cudnn", None, None, 802.0, "__cudnn$fmhaScaleBiasSoftmax"),
        Compiled("mixtral", "dot", 687.2, None, 5120.0, "-"),
        Compiled("mixtral", "blockwise", None, 541.2, 224.4, "-"),
        Compiled("mixtral", "cudnn", None, None, 128.5, "__cudnn$fmhaScaleBiasSoftmax"),
    ),
    "tpu": (
        Compiled("deepseek3", "dot", 3573.4, None, 12678.4, "-"),
        Compiled("deepseek3", "blockwise", None, 2783.1, 1446.5, "-"),
        Compiled("deepseek3", "splash", None, 3556.2, 1405.3, "tpu_custom_call"),
        Compiled("mixtral", "dot", 687.2, None, 3105.3, "-"),
        Compiled("mixtral", "blockwise", None, 541.2, 123.7, "-"),
        Compiled("mixtral", "splash", None, 695.8, 87.2, "tpu_custom_call"),
    ),
}
AUTO = {p: dataclasses.replace(c, compiled=COMPILED_ROWS.get(p, ())) for p, c in AUTO.items()}
