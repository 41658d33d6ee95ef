"""expertax parameters -> HF safetensors, streamed: one tensor (or block of rows) at a time.

The source is any `read(leaf, where) -> np.ndarray` (an open model directory reads only that
region from disk). Shards are planned from shapes, each written by `safetensors_io.write_file`
while worker threads compute the next blocks (read, transform, optionally quantize to fp8), at
most a few blocks ahead; a shard already complete from an interrupted run is not rewritten.
A shared copy (`TensorMap.shared`: a multi-token-prediction layer's embed_tokens and
shared_head.head) is the main tensor's leaf written under the copy's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from expertax.config import Config
from expertax.convert import fp8, hf_gpt_oss, safetensors_io
from expertax.convert.errors import ConversionError
from expertax.convert.hf import TensorMap, hf_shape, tensor_map, to_hf, transpose
from expertax.convert.hf_config import config_to_hf
from expertax.convert.hf_read import CHUNK_BYTES

Read = Callable[[str, tuple], np.ndarray]  # (leaf, where) -> the region's values


@dataclasses.dataclass(frozen=True)
class Job:
    """Rows [a, b) of one HF tensor (and, for fp8, of its scale grid); for GPT-OSS's fused
    expert tensors, experts [a, b)."""

    t: TensorMap | None  # None: a fused expert tensor, `fused`
    rows: tuple[int, int] | None
    quantize: bool
    fused: tuple[str, str, int, str] | None = None  # (HF name, MoE leaves, layer, which)

    @property
    def name(self) -> str:
        if self.t is not None:
            return self.t.hf_name
        assert self.fused is not None  # one of the two is set
        return self.fused[0]


def quantized(t: TensorMap) -> bool:
    """Whether DeepSeek-V3's hub checkpoint keeps this tensor in fp8: every linear weight but
    the router, lm_head and, in the multi-token-prediction layer, eh_proj and the output head's
    copy (shared_head.head)."""
    bf16 = t.leaf.endswith("router.w") or t.leaf in ("lm_head", "mtp.eh_proj")
    return t.kind == "linear" and not bf16


def plan(
    c: Config, shapes: dict[str, tuple], dtypes: dict[str, np.dtype], base: dict, use_fp8: bool
):
    """(HF config dict, entries, jobs by tensor name)."""
    hf = config_to_hf(c, base)
    interleave = c.attention_type == "mla" and bool(base.get("rope_interleave", True))
    if c.attention_type == "mla" and hf["model_type"] != "deepseek_v2":  # V2: always
        hf["rope_interleave"] = interleave
    gpt_oss = c.decoder_block == "gpt_oss"
    if use_fp8 and gpt_oss:
        raise ConversionError(
            "to-hf --fp8 (use_fp8) writes DeepSeek-V3's fp8 block format; decoder_block="
            "'gpt_oss' is written in its own dtype (the hub's MXFP4 is not written)"
        )
    if use_fp8:
        hf["quantization_config"] = dict(fp8.HUB_QUANTIZATION_CONFIG)
    entries: list[safetensors_io.Entry] = []
    jobs: dict[str, list[Job]] = {}
    for t in tensor_map(c, interleave=interleave):
        shape = hf_shape(t, tuple(shapes[t.leaf][len(t.index) :]))
        q = use_fp8 and quantized(t) and len(shape) == 2
        dtype = fp8.FP8 if q else dtypes[t.leaf]
        entries.append((t.hf_name, shape, dtype))
        if q:
            entries.append(
                (fp8.scale_name(t.hf_name), fp8.scale_shape(shape), np.dtype(np.float32))
            )
        slice_ndim = len(shapes[t.leaf]) - len(t.index)
        row_bytes = shape[-1] * np.dtype(dtypes[t.leaf]).itemsize
        rows_of_2d = slice_ndim == 2 and len(shape) == 2 and t.rope is None
        if rows_of_2d and row_bytes * shape[0] > CHUNK_BYTES:
            rows = max(fp8.BLOCK, CHUNK_BYTES // row_bytes // fp8.BLOCK * fp8.BLOCK)
            jobs[t.hf_name] = [
                Job(t, (a, min(a + rows, shape[0])), q) for a in range(0, shape[0], rows)
            ]
        else:
            jobs[t.hf_name] = [Job(t, None, q)]
        if gpt_oss and t.hf_name.endswith("mlp.router.bias"):  # the layer's experts follow
            _fused(c, t.index[0], t.hf_name.removesuffix("router.bias"), dtypes, entries, jobs)
    return hf, entries, jobs


def _fused(c: Config, i: int, prefix: str, dtypes, entries: list, jobs: dict) -> None:
    """GPT-OSS's fused expert tensors of MoE layer `i`, in jobs of whole experts of at most
    CHUNK_BYTES."""
    for which, shape in hf_gpt_oss.fused_shapes(c).items():
        name, m = f"{prefix}experts.{which}", "moe_layers.moe"
        dtype = np.dtype(dtypes[f"{m}.{hf_gpt_oss.FUSED_LEAVES[which][0]}"])
        entries.append((name, shape, dtype))
        per_expert = int(np.prod(shape[1:])) * dtype.itemsize
        step, e = max(1, CHUNK_BYTES // per_expert), shape[0]
        jobs[name] = [
            Job(None, (a, min(a + step, e)), False, (name, m, i, which)) for a in range(0, e, step)
        ]


def run_job(read: Read, job: Job, hints) -> tuple[np.ndarray, np.ndarray | None]:
    """The job's rows of the HF tensor (fp8 values and their scale rows when quantizing)."""
    t = job.t
    if t is None:
        assert job.fused is not None and job.rows is not None  # a fused tensor's experts
        _, m, i, which = job.fused
        experts = slice(*job.rows)
        leaves = [read(f"{m}.{leaf}", (i, experts)) for leaf in hf_gpt_oss.FUSED_LEAVES[which]]
        return hf_gpt_oss.join_fused(which, leaves), None
    if job.rows is None:
        w = to_hf(t, read(t.leaf, t.index))
    elif t.kind == "copy":
        w = read(t.leaf, (*t.index, slice(*job.rows)))
    else:
        w = transpose(read(t.leaf, (*t.index, slice(None), slice(*job.rows))))
    if not job.quantize:
        return w, None
    hint = hints(t.hf_name)
    if hint is not None and job.rows is not None:
        hint = hint[job.rows[0] // fp8.BLOCK : -(-job.rows[1] // fp8.BLOCK)]
    return fp8.quantize(w, hint)


def shard_blocks(
    read: Read,
    entries: list[safetensors_io.Entry],
    jobs: dict[str, list[Job]],
    hints,
    pool: ThreadPoolExecutor,
    on_block: Callable[[int], None],
    ahead: int,
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, rows) of one shard in file order; `ahead` blocks are computed in advance."""
    work = [job for name, _, _ in entries if name in jobs for job in jobs[name]]
    futures: list[Any] = [pool.submit(run_job, read, job, hints) for job in work[:ahead]]
    scales: list[np.ndarray] = []
    for k, job in enumerate(work):
        w, s = futures[k].result()
        futures[k] = None  # release the block once written
        if k + ahead < len(work):
            futures.append(pool.submit(run_job, read, work[k + ahead], hints))
        yield job.name, w
        on_block(w.nbytes)
        if s is not None:
            scales.append(s)
            last = k + 1 == len(work) or work[k + 1].name != job.name
            if last:
                yield fp8.scale_name(job.name), np.concatenate(scales)
                scales = []


def write_shards(
    out_dir: Path,
    read: Read,
    entries: list[safetensors_io.Entry],
    jobs: dict[str, list[Job]],
    *,
    max_shard_bytes: int,
    hints=lambda name: None,
    on_block: Callable[[int], None] = lambda n: None,
    on_shard: Callable[[str], None] = lambda fname: None,
    workers: int = 2,
) -> tuple[list[str], int]:
    """Write every shard not already complete; (files, shards skipped as already written)."""
    shards = safetensors_io.plan_shards(entries, max_shard_bytes)
    skipped = 0
    with ThreadPoolExecutor(workers, thread_name_prefix="to-hf") as pool:
        for fname, shard in shards:
            if (out_dir / fname).is_file():
                skipped += 1
                continue
            blocks = shard_blocks(read, shard, jobs, hints, pool, on_block, ahead=workers + 1)
            safetensors_io.write_file(out_dir / fname, shard, blocks)
            on_shard(fname)
    files = [fname for fname, _ in shards]
    if len(shards) > 1:
        safetensors_io.write_index(out_dir, shards)
        files.append(safetensors_io.INDEX_FILE)
    return files, skipped
