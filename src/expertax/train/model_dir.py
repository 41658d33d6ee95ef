"""The converted-model directory: a config and the parameters, readable by Orbax.

```
OUT_DIR/
  expertax_model.json   marker {"format": "expertax-model", "version": 2, "source": ...},
                        written last: a directory without it is incomplete
  config.yml            the full resolved Config (every key), loadable by `expertax train`
  hf_config.json        the source HF config.json (only when converted from HF)
  hf_fp8_scales.safetensors  the fp8 block scales of the source (only from an fp8 checkpoint)
  tokenizer.json        the source's tokenizer, with tokenizer_config.json and
                        special_tokens_map.json where it has them (from HF, when present)
  params/               the `Decoder` parameter pytree in Orbax's PyTree layout without OCDBT:
                        one uncompressed zarr array per leaf (`params/<leaf path>/`), chunked one
                        layer (and one expert) at a time, plus Orbax's `_METADATA`
```
The parameter tree is exactly `models.decoder.Decoder` (as `init_params` returns it), each leaf
in its own stored dtype (the HF DeepSeek routing bias stays float32 next to bfloat16 weights).
`ParamsWriter` writes the arrays region by region (a converter never holds a whole leaf), and
`load` restores them with Orbax (into any shardings); version 1 directories (OCDBT, written by
Orbax itself) load the same way.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from expertax import jsonio
from expertax.config import Config, config_to_yaml
from expertax.models import decoder
from expertax.nn.param import is_spec
from expertax.preflight import build_config
from expertax.train import config_file

FORMAT = "expertax-model"
FORMAT_VERSION = 2
MARKER = "expertax_model.json"
PARAMS_DIR = "params"
HF_CONFIG = "hf_config.json"
# Copied from an HF folder as they are (`expertax generate` reads tokenizer.json).
# The HF folder's tokenizer files (tokenizer.json first: `expertax generate` reads it), its chat
# template and generation defaults: copied as they are by from-hf, and back by to-hf.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
FP8_SCALES = "hf_fp8_scales.safetensors"
CHUNK_BYTES = 64 * 2**20  # the most bytes of one stored chunk that `default_chunks` picks
_ORBAX_FILES = ("_METADATA", "_CHECKPOINT_METADATA")


def check_new_dir(out_dir: str | Path) -> Path:
    """`out_dir` resolved; a file or a non-empty directory is refused (nothing is overwritten)."""
    out = Path(out_dir).resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"output directory {out} is a file; give a new folder")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {out} is not empty; choose a new one")
    return out


def leaf_paths(c: Config) -> dict[str, jax.ShapeDtypeStruct]:
    """Every parameter leaf of `c`'s model by dotted path (its directory name under params/)."""
    flat = jax.tree_util.tree_flatten_with_path(decoder.spec(c), is_leaf=is_spec)[0]
    return {".".join(k.name for k in path): s for path, s in flat}


def default_chunks(shape: tuple[int, ...], dtype) -> tuple[int, ...]:
    """Leading axes cut to 1 until a chunk holds at most CHUNK_BYTES (a layer, an expert)."""
    chunks = list(shape)
    for axis in range(len(shape) - 1):
        if int(np.prod(chunks, dtype=np.int64)) * np.dtype(dtype).itemsize <= CHUNK_BYTES:
            break
        chunks[axis] = 1
    return tuple(chunks)


def settle(fd: int, offset: int = 0, length: int = 0) -> None:
    """Make the written bytes `[offset, offset + length)` of open file `fd` durable (length 0:
    to the end), then drop them from the page cache.

    Converters write far more than memory holds; without this, every written page stays cached
    until the kernel reclaims it, and on hosts where fresh page-cache pages are expensive (a VM
    whose memory the hypervisor backs lazily: about 2.5 s of kernel time per GiB on our 2-core
    machine, against 0.3 s when pages are recycled) the writes run at the cost of new pages.
    Dropped pages are reused at once by the next writes. It also makes the resume journal honest:
    a unit is journaled only after its bytes are on disk.
    """
    os.fdatasync(fd)
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _zarr_spec(path: Path) -> dict:
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}}


def chunk_keys(shape: tuple, chunks: tuple, where: tuple) -> list[str]:
    """The zarr (v2, "." separated) keys of the chunks that `array[where]` touches."""
    ranges = []
    for axis, (n, c) in enumerate(zip(shape, chunks, strict=True)):
        w = where[axis] if axis < len(where) else slice(None)
        start, stop = (w, w + 1) if isinstance(w, int | np.integer) else w.indices(n)[:2]
        ranges.append(range(start // c, -(-stop // c)))
    return [".".join(map(str, key)) for key in itertools.product(*ranges)]


class ParamsWriter:
    """Writes `OUT_DIR/params/` one region of one leaf at a time (from several threads).

    `layouts` gives each leaf's (shape, dtype, chunk shape). Arrays are created, or opened when
    a resumed conversion finds them (same layout), as uncompressed zarr: compressing bfloat16
    weights saves little and costs a core. tensorstore writes each chunk file whole, through a
    temporary name, so a killed writer leaves whole chunks. `finish` adds Orbax's metadata.
    """

    def __init__(self, out_dir: str | Path, layouts: dict[str, tuple[tuple, np.dtype, tuple]]):
        self.params_dir = Path(out_dir) / PARAMS_DIR
        self.params_dir.mkdir(parents=True, exist_ok=True)
        self.arrays = {}
        # `write` syncs each chunk file itself (`settle`); tensorstore's own fsync of every
        # file and directory would come on top
        self._context = ts.Context({"file_io_sync": False})
        self.chunks = {leaf: tuple(chunks) for leaf, (_, _, chunks) in layouts.items()}
        for leaf, (shape, dtype, chunks) in layouts.items():
            metadata = {
                "shape": list(shape),
                "chunks": list(chunks),
                "compressor": None,
                "dimension_separator": ".",
            }
            spec = {**_zarr_spec(self.params_dir / leaf), "metadata": metadata}
            self.arrays[leaf] = ts.open(
                spec,
                dtype=ts.dtype(np.dtype(dtype).name),
                create=True,
                open=True,
                context=self._context,
            ).result()

    def write(self, leaf: str, where: tuple, value: np.ndarray) -> None:
        """Store `value` at `leaf[where]` (a tuple of ints and slices); its chunk files are on
        disk and out of the page cache (`settle`) when this returns."""
        array, chunks = self.arrays[leaf], self.chunks[leaf]
        keys = chunk_keys(tuple(array.shape), chunks, where)
        leaf_dir = self.params_dir / leaf
        if len(keys) == 1 and value.size == int(np.prod(chunks, dtype=np.int64)):
            # exactly one whole chunk: its file is the value's bytes (uncompressed zarr v2,
            # C order), written here directly, which spares tensorstore's copy of the chunk
            self._write_chunk(leaf_dir / keys[0], np.ascontiguousarray(value, self.dtype(leaf)))
            return
        array[where].write(value).result()
        for key in keys:
            fd = os.open(leaf_dir / key, os.O_RDONLY)
            try:
                settle(fd)
            finally:
                os.close(fd)

    @staticmethod
    def _write_chunk(path: Path, value: np.ndarray) -> None:
        """Write a chunk file whole, through a temporary name (as tensorstore does)."""
        tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view, done = memoryview(value.reshape(-1).view(np.uint8).data), 0
            while done < len(view):
                done += os.write(fd, view[done:])
            settle(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def finish(self, c: Config) -> None:
        """Orbax's tree metadata, from an Orbax save of the same tree with one-element leaves:
        Orbax's own code names the leaves and records their types, so `load` reads the arrays
        back exactly as if Orbax had written them."""
        proxy_dir = self.params_dir.parent / ".orbax-layout"
        shutil.rmtree(proxy_dir, ignore_errors=True)
        proxy = jax.tree_util.tree_map_with_path(
            lambda path, s: np.zeros(
                (1,) * len(s.shape), self.dtype(".".join(k.name for k in path))
            ),
            decoder.spec(c),
            is_leaf=is_spec,
        )
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False)
        with ocp.Checkpointer(handler) as ckptr:
            ckptr.save(proxy_dir, args=ocp.args.PyTreeSave(proxy))
        names = {p.name for p in proxy_dir.iterdir() if p.is_dir()}
        if names != set(self.arrays):
            raise RuntimeError(
                f"Orbax names the leaves {sorted(names)}, ours {sorted(self.arrays)}"
            )
        for name in _ORBAX_FILES:
            shutil.copyfile(proxy_dir / name, self.params_dir / name)
        shutil.rmtree(proxy_dir)

    def dtype(self, leaf: str) -> np.dtype:
        return np.dtype(self.arrays[leaf].dtype.numpy_dtype)


def write_meta(out_dir: str | Path, c: Config, *, hf_config: dict | None = None) -> None:
    """config.yml and hf_config.json (before the parameters, so a resumed run can compare)."""
    out = Path(out_dir)
    (out / "config.yml").write_text(config_to_yaml(c))
    if hf_config is not None:
        (out / HF_CONFIG).write_text(jsonio.dumps(hf_config, indent=2, sort_keys=True) + "\n")


def write_marker(out_dir: str | Path, *, source: str) -> None:
    """The marker that makes the directory a model directory: written last."""
    marker = {"format": FORMAT, "version": FORMAT_VERSION, "source": source}
    tmp = Path(out_dir) / (MARKER + ".tmp")
    tmp.write_text(jsonio.dumps(marker) + "\n")
    tmp.replace(Path(out_dir) / MARKER)


def save(out_dir: str | Path, c: Config, params, *, source: str, hf_config: dict | None = None):
    """Write a model directory from in-memory parameters; `out_dir` must not exist or be empty."""
    out = check_new_dir(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_meta(out, c, hf_config=hf_config)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    leaves = {".".join(k.name for k in path): np.asarray(x) for path, x in flat}
    layouts = {k: (x.shape, x.dtype, default_chunks(x.shape, x.dtype)) for k, x in leaves.items()}
    writer = ParamsWriter(out, layouts)
    for leaf, x in leaves.items():
        per_row = x.ndim > 1 and layouts[leaf][2][0] == 1
        for where in [(i,) for i in range(x.shape[0])] if per_row else [()]:
            writer.write(leaf, where, x[where])
    writer.finish(c)
    write_marker(out, source=source)


def read_region(ckpt_dir: str | Path, array: ts.TensorStore, leaf: str, where: tuple) -> np.ndarray:
    """`array[where]` of leaf `leaf` (from `open_leaves`), its chunk files then dropped from the
    page cache (a converter reads each once; see `settle`)."""
    value = array[where].read().result()
    chunks = tuple(array.chunk_layout.read_chunk.shape or ())
    for key in chunk_keys(tuple(array.shape), chunks, where):
        fd = os.open(Path(ckpt_dir) / PARAMS_DIR / leaf / key, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return value


def open_leaves(ckpt_dir: str | Path) -> dict[str, ts.TensorStore] | None:
    """Each leaf of a version-2 model directory as an open tensorstore array (read a region at
    a time), or None for a directory whose params/ Orbax wrote with OCDBT (version 1)."""
    params = Path(ckpt_dir) / PARAMS_DIR
    meta = (
        json.loads((params / "_METADATA").read_text()) if (params / "_METADATA").is_file() else {}
    )
    if meta.get("use_ocdbt", True):
        return None
    c = read_config(ckpt_dir)
    return {leaf: ts.open(_zarr_spec(params / leaf), open=True).result() for leaf in leaf_paths(c)}


def read_config(ckpt_dir: str | Path) -> Config:
    """The Config of an expertax model directory; ValueError if `ckpt_dir` is not one."""
    path = Path(ckpt_dir).resolve()
    marker = path / MARKER
    if not marker.is_file():
        raise ValueError(f"{path} is not an expertax model directory (no {MARKER})")
    try:
        content = json.loads(marker.read_text())
    except ValueError:
        content = None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise ValueError(f"{path}: {MARKER} is not expertax's")
    fix = "convert the model again into a new directory"
    return build_config(config_file.read_saved(path / "config.yml", fix))


def load(ckpt_dir: str | Path, shardings=None) -> tuple[Config, decoder.Decoder, dict | None]:
    """(Config, parameters, source HF config or None).

    Parameters land on the first device, or in `shardings` (a `Decoder` tree of shardings, e.g.
    `nn.param.shardings(decoder.spec(c), mesh, rules)`), read straight into each shard by Orbax.
    """
    path = Path(ckpt_dir).resolve()
    c = read_config(path)
    hf_path = path / HF_CONFIG
    hf_config = json.loads(hf_path.read_text()) if hf_path.is_file() else None
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path / PARAMS_DIR)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        spec = decoder.spec(c)
        if shardings is None:
            shardings = jax.tree.map(lambda _: device, spec, is_leaf=is_spec)

        def target(key_path, s, sharding):
            node = tree
            for k in key_path:
                node = node[k.name]
            return jax.ShapeDtypeStruct(s.shape, node.dtype, sharding=sharding)

        abstract = jax.tree_util.tree_map_with_path(target, spec, shardings, is_leaf=is_spec)
        params = ckptr.restore(path / PARAMS_DIR, abstract)
    return c, params, hf_config
