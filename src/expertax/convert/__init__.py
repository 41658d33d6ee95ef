"""HuggingFace <-> expertax conversion (DeepSeek-V3, Kimi-K2, DeepSeek-V2, GLM-4.5, Mixtral,
Qwen3-MoE, GPT-OSS); docs/design/convert.md.

load_hf(hf_dir) -> (config, params)          an HF checkpoint, ready for `expertax.logits`
from_hf(hf_dir, out_dir) -> Config            HF checkpoint -> expertax model directory
to_hf(ckpt_dir, out_dir) -> list of files     expertax model or training run dir -> HF checkpoint

Both directions stream (memory: a few tensors, not the model), use `workers` threads, show a
progress line on a terminal, and resume: rerun the same command after an interruption.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from expertax import jsonio
from expertax.config import Config
from expertax.convert import fp8, hf_read, hf_write, safetensors_io
from expertax.convert.errors import ShapeError
from expertax.convert.hf_config import (
    ConversionError,
    config_from_hf,
    config_to_hf,
    defaults_taken,
)
from expertax.convert.progress import Journal, Progress
from expertax.errors import ConfigError
from expertax.models import decoder
from expertax.nn.param import is_spec
from expertax.train import model_dir, params_io


@dataclasses.dataclass
class Summary:
    """What a conversion did (the CLI prints it)."""

    config: Config
    tensors: int = 0  # units converted by this run (tensors, or row blocks of large ones)
    resumed: int = 0  # units already done by an interrupted run, not redone
    gib: float = 0.0
    seconds: float = 0.0
    files: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        rate = self.gib / self.seconds if self.seconds > 0 else 0.0
        return (
            f"{self.tensors} tensors converted ({self.gib:.2f} GiB, {self.seconds:.1f} s, "
            f"{rate:.2f} GiB/s), {self.resumed} already done by an earlier run"
        )


def load_hf(hf_dir: str | Path, *, workers: int = 2) -> tuple[Config, object]:
    """The Config and parameters (jax arrays) of an HF checkpoint of a supported family
    (hf_config.SUPPORTED)."""
    c, params, _ = params_from_hf(hf_dir, workers=workers)
    return c, jax.tree.map(jnp.asarray, params)


def params_from_hf(hf_dir: str | Path, *, workers: int = 2):
    """(Config, numpy parameters, HF config dict), in memory (the model once, plus a few units)."""
    hf = hf_read.read_hf_config(hf_dir)
    with safetensors_io.Reader(hf_dir) as reader:
        p = hf_read.plan(reader, hf)
        hf_read.check_shared(reader, p, workers=workers)
        arrays = {leaf: np.empty(shape, dtype) for leaf, (shape, dtype, _) in p.layouts.items()}

        def write(leaf, where, value):
            arrays[leaf][where] = value

        hf_read.run(reader, p, write, workers=workers)
    flat, treedef = jax.tree_util.tree_flatten_with_path(decoder.spec(p.c), is_leaf=is_spec)
    leaves = [arrays[".".join(k.name for k in path)] for path, _ in flat]
    return p.c, jax.tree.unflatten(treedef, leaves), hf


def _prepare_out(out_dir: str | Path, state: dict) -> Journal:
    """A new or empty `out_dir`, or one holding an interrupted run of the same conversion."""
    out = Path(out_dir).resolve()
    if not Journal.resumable(out):
        model_dir.check_new_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    return Journal(out, state).open()


def convert_from_hf(hf_dir: str | Path, out_dir: str | Path, *, workers: int = 2) -> Summary:
    """HF checkpoint -> expertax model directory, streamed and resumable (see module doc)."""
    start = time.perf_counter()
    hf_dir = Path(hf_dir).resolve()
    hf = hf_read.read_hf_config(hf_dir)
    out = Path(out_dir).resolve()
    with safetensors_io.Reader(hf_dir) as reader:
        try:  # refusals before anything is written
            p = hf_read.plan(reader, hf)
        except ShapeError as e:  # a field config.json left out may be why
            raise ShapeError(f"{e}{defaults_taken(hf)}") from None
        hf_read.check_shared(reader, p, workers=workers)
        journal = _prepare_out(out, {"direction": "from-hf", "source": str(hf_dir)})
        summary = Summary(p.c, notes=p.notes)
        summary.resumed = sum(u.key in journal.done for u in p.units)
        model_dir.write_meta(out, p.c, hf_config=hf)
        writer = model_dir.ParamsWriter(out, p.layouts)
        todo_bytes = sum(u.nbytes for u in p.units if u.key not in journal.done)
        progress = Progress("from-hf", len(p.units) - summary.resumed, todo_bytes)

        def on_done(u: hf_read.Unit) -> None:
            journal.add(u.key)
            progress.advance(u.nbytes)

        summary.tensors = hf_read.run(
            reader, p, writer.write, done=journal.done, on_done=on_done, workers=workers
        )
        progress.close()
        if p.fp8:  # kept so that to-hf --fp8 writes the same bytes back
            scales = [n for n in reader.names() if n.endswith(fp8.SCALE_SUFFIX)]
            entries = [(n, reader.shape(n), reader.dtype(n)) for n in scales]
            safetensors_io.write_file(
                out / model_dir.FP8_SCALES, entries, ((n, reader.get(n)) for n in scales)
            )
        writer.finish(p.c)
    _copy_tokenizer_files(hf_dir, out)  # as they are, for `expertax generate`
    model_dir.write_marker(out, source="huggingface")
    journal.finish()
    summary.gib = todo_bytes / 2**30
    summary.seconds = time.perf_counter() - start
    return summary


def _copy_tokenizer_files(src: Path, out: Path) -> list[str]:
    """Copy the tokenizer files (model_dir.TOKENIZER_FILES) found in `src` into `out`."""
    found = [name for name in model_dir.TOKENIZER_FILES if (src / name).is_file()]
    for name in found:
        shutil.copyfile(src / name, out / name)
    return found


def from_hf(hf_dir: str | Path, out_dir: str | Path, *, workers: int = 2) -> Config:
    """Convert an HF checkpoint directory into an expertax model directory (see `model_dir`)."""
    return convert_from_hf(hf_dir, out_dir, workers=workers).config


def _source(ckpt_dir: str | Path):
    """(Config, read(leaf, where), shapes, dtypes, base HF config, fp8 scale hints)."""
    if params_io.is_run_dir(ckpt_dir):  # a training checkpoint: the parameters in memory
        c, params, _ = params_io.load_run_params(ckpt_dir)
        return (c, *_in_memory(params), _source_hf_config(c), None)
    leaves = model_dir.open_leaves(ckpt_dir)
    if leaves is None:  # a version-1 model directory (Orbax OCDBT): in memory
        c, params, hf = model_dir.load(ckpt_dir)
        return (c, *_in_memory(params), hf, Path(ckpt_dir) / model_dir.FP8_SCALES)
    c = model_dir.read_config(ckpt_dir)
    hf_path = Path(ckpt_dir) / model_dir.HF_CONFIG
    hf = json.loads(hf_path.read_text()) if hf_path.is_file() else None

    def read(leaf, where):
        return model_dir.read_region(ckpt_dir, leaves[leaf], leaf, where)

    shapes = {k: tuple(v.shape) for k, v in leaves.items()}
    dtypes = {k: np.dtype(v.dtype.numpy_dtype) for k, v in leaves.items()}
    return c, read, shapes, dtypes, hf, Path(ckpt_dir) / model_dir.FP8_SCALES


def _in_memory(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    leaves = {".".join(k.name for k in path): np.asarray(x) for path, x in flat}
    return (
        lambda leaf, where: leaves[leaf][where],
        {k: x.shape for k, x in leaves.items()},
        {k: x.dtype for k, x in leaves.items()},
    )


def _hints(scales_file: Path | None):
    """name -> the fp8 scale grid the model was read with (None when it did not come from fp8)."""
    if scales_file is None or not scales_file.is_file():
        return lambda name: None
    try:  # open for the conversion; read-only, thread-safe
        handle = safe_open(scales_file, "numpy")
    except Exception as e:  # safetensors' Rust side raises its own error type for a bad header
        raise ConfigError(f"{scales_file} is damaged ({type(e).__name__}: {e})") from None
    names = set(handle.keys())

    def hint(name: str) -> np.ndarray | None:
        scale = fp8.scale_name(name)
        return handle.get_tensor(scale) if scale in names else None

    return hint


def convert_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
    use_fp8: bool = False,
    workers: int = 2,
) -> Summary:
    """expertax model directory (or training run) -> HF checkpoint, streamed and resumable."""
    start = time.perf_counter()
    c, read, shapes, dtypes, base, scales_file = _source(ckpt_dir)
    hf, entries, jobs = hf_write.plan(c, shapes, dtypes, dict(base or {}), use_fp8)
    out = Path(out_dir).resolve()
    state = {
        "direction": "to-hf",
        "source": str(Path(ckpt_dir).resolve()),
        "fp8": use_fp8,
        "max_shard_bytes": max_shard_bytes,
    }
    journal = _prepare_out(out, state)
    total = sum(safetensors_io.nbytes(s, d) for _, s, d in entries)
    progress = Progress("to-hf", sum(len(j) for j in jobs.values()), total)
    summary = Summary(c)

    def on_block(n: int) -> None:
        progress.advance(n)
        summary.tensors += 1

    files, skipped = hf_write.write_shards(
        out,
        read,
        entries,
        jobs,
        max_shard_bytes=max_shard_bytes,
        hints=_hints(scales_file) if use_fp8 else (lambda name: None),
        on_block=on_block,
        on_shard=journal.add,
        workers=workers,
    )
    progress.close()
    (out / "config.json").write_text(jsonio.dumps(hf, indent=2, sort_keys=True) + "\n")
    tokenizer = _copy_tokenizer_files(_model_dir_of(ckpt_dir, c), out)
    journal.finish()
    summary.resumed = skipped
    summary.files = ["config.json", *files, *tokenizer]
    summary.gib = progress.done_bytes / 2**30
    summary.seconds = time.perf_counter() - start
    return summary


def to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
    use_fp8: bool = False,
    workers: int = 2,
) -> list[str]:
    """Convert into config.json + safetensors for transformers: an expertax model directory, or
    a training run directory (`<base_output_directory>/<run_name>`: the parameters of its latest
    complete checkpoint). `use_fp8`: linear weights in DeepSeek-V3's fp8 block format."""
    summary = convert_to_hf(
        ckpt_dir, out_dir, max_shard_bytes=max_shard_bytes, use_fp8=use_fp8, workers=workers
    )
    return summary.files


def write_hf(
    params: decoder.Decoder,
    c: Config,
    out_dir: str | Path,
    *,
    base_config: dict | None = None,
    max_shard_bytes: int = 5 * 2**30,
    use_fp8: bool = False,
) -> list[str]:
    """Write in-memory parameters as config.json and (sharded) safetensors for transformers.

    `base_config` (the original HF config.json, when the model came from HF) supplies fields
    expertax does not model (token ids, max_position_embeddings) and the RoPE layout.
    """
    read, shapes, dtypes = _in_memory(params)
    hf, entries, jobs = hf_write.plan(c, shapes, dtypes, dict(base_config or {}), use_fp8)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files, _ = hf_write.write_shards(out, read, entries, jobs, max_shard_bytes=max_shard_bytes)
    (out / "config.json").write_text(jsonio.dumps(hf, indent=2, sort_keys=True) + "\n")
    return ["config.json", *files]


def _model_dir_of(ckpt_dir: str | Path, c: Config) -> Path:
    """The model directory holding the source's tokenizer files: `ckpt_dir` itself, or for a
    training run the model directory it started from (load_parameters_path)."""
    if params_io.is_run_dir(ckpt_dir) and c.load_parameters_path:
        return Path(c.load_parameters_path)
    return Path(ckpt_dir)


def _source_hf_config(c: Config) -> dict | None:
    """The HF config.json a run started from (through load_parameters_path), if still there: it
    supplies the fields expertax does not model (token ids, max_position_embeddings)."""
    path = Path(c.load_parameters_path) / model_dir.HF_CONFIG
    if not c.load_parameters_path or not path.is_file():
        return None
    return json.loads(path.read_text())


__all__ = [
    "ConversionError",
    "Summary",
    "config_from_hf",
    "config_to_hf",
    "convert_from_hf",
    "convert_to_hf",
    "from_hf",
    "load_hf",
    "params_from_hf",
    "to_hf",
    "write_hf",
]
