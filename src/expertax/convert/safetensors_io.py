"""Reading and writing (sharded) safetensors one tensor, or one block of rows, at a time.

A checkpoint directory holds either `model.safetensors`, or shards listed in
`model.safetensors.index.json` (`{"metadata": {...}, "weight_map": {name: file}}`), the layout
transformers writes. Reading parses each file's header and copies out one tensor or a block of
its rows per call with `pread`.

Writing streams: the `safetensors` library only writes a file from a dict of complete arrays
(the whole shard in memory), so `write_file` writes the format itself — an 8-byte little-endian
header length, the JSON header (names, dtypes, shapes, byte offsets; planned from the shapes
alone), then each tensor's bytes in header order — one block at a time, into `NAME.partial`,
renamed to NAME when complete. The tests read every written file back with `safe_open`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from expertax import jsonio
from expertax.errors import ConfigError
from expertax.train import model_dir

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PARTIAL = ".partial"
SETTLE_BYTES = 64 * 2**20  # write_file settles (syncs and uncaches) its bytes this often

# safetensors' numpy reader looks fp8 up as `numpy.float8_e4m3fn`, which numpy does not define
# (bfloat16 it finds through ml_dtypes' registration). Give it ml_dtypes' type, the same object
# that jax uses, so fp8 tensors read as ml_dtypes.float8_e4m3fn arrays.
if not hasattr(np, "float8_e4m3fn"):
    np.float8_e4m3fn = ml_dtypes.float8_e4m3fn  # type: ignore[attr-defined]

_DTYPE_NAMES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint8): "U8",  # MXFP4 blocks and scales
}
_FROM_NAMES = {v: k for k, v in _DTYPE_NAMES.items()}


class Reader:
    """Tensor names, shapes, dtypes and values of an HF checkpoint directory.

    Reads with `pread` into a new array and then drops the bytes read from the page cache
    (`model_dir.settle`'s reason: a conversion reads each byte once, and on our VM fresh cache
    pages are expensive), rather than through safetensors' memory map, whose pages stay mapped
    (and counted in the RSS) until the file is closed. Thread-safe. Every header is read, and
    checked against the file's size, when the Reader opens: a damaged or cut-off file is a
    ConfigError before anything is converted.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        weight_map = _read_index(index) if index.is_file() else None
        if weight_map is not None:
            files = sorted(set(weight_map.values()))
        elif (self.directory / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            raise FileNotFoundError(f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._fds: dict[str, int] = {}
        self._tensors: dict[str, tuple[str, np.dtype, tuple[int, ...], int]] = {}
        try:
            for fname in files:
                self._fds[fname] = fd = os.open(self.directory / fname, os.O_RDONLY)
                for name, (dtype, shape, offset) in read_header(
                    fd, str(self.directory / fname)
                ).items():
                    self._tensors[name] = (fname, dtype, shape, offset)
        except BaseException:
            self.close()
            raise
        if weight_map is not None:  # the index must agree with the files
            wrong = [n for n, f in weight_map.items() if self._tensors.get(n, ("",))[0] != f]
            if wrong:
                raise ValueError(f"{index}: tensors {wrong[:3]} are not in the files it names")
            self._tensors = {n: self._tensors[n] for n in weight_map}

    @property
    def weight_map(self) -> dict[str, str]:
        return {name: t[0] for name, t in self._tensors.items()}

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name][2]

    def dtype(self, name: str) -> np.dtype:
        return self._tensors[name][1]

    def get(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """One tensor (or its rows [a, b)) as a new numpy array; bfloat16 and fp8 as ml_dtypes."""
        fname, dtype, shape, offset = self._tensors[name]
        if rows is not None:
            row_bytes = nbytes(shape[1:], dtype)
            offset += rows[0] * row_bytes
            shape = (rows[1] - rows[0], *shape[1:])
        out = np.empty(shape, dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8).data)
        fd, done = self._fds[fname], 0
        while done < len(buf):  # pread returns at most ~2 GiB at a time
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n == 0:
                raise ValueError(f"{self.directory / fname} ends inside tensor {name}")
            done += n
        os.posix_fadvise(fd, offset, len(buf), os.POSIX_FADV_DONTNEED)
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_header(fd: int, fname: str) -> dict[str, tuple[np.dtype, tuple[int, ...], int]]:
    """name -> (dtype, shape, absolute byte offset) of every tensor of an open safetensors file
    (`fname`, its path in messages); ConfigError naming the file and what is wrong with it."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise ConfigError(f"{fname} is not a safetensors file: {size} bytes, no header length")
    (length,) = struct.unpack("<Q", head)
    if length > size - 8:
        raise ConfigError(
            f"{fname} has a damaged safetensors header: its length field says {length} bytes, "
            f"the file holds {size - 8} after it"
        )
    try:
        header = json.loads(os.pread(fd, length, 8))
    except ValueError as e:  # not UTF-8, or not JSON
        raise ConfigError(f"{fname} has a damaged safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{fname} has a damaged safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        try:
            kind, shape = info["dtype"], tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"{fname} has a damaged safetensors header: the entry of tensor {name!r} is "
                f"{str(info)[:120]} (expected dtype, shape and data_offsets)"
            ) from None
        if not isinstance(kind, str) or kind not in _FROM_NAMES:
            raise ConfigError(
                f"{fname}: tensor {name} has dtype {kind!r}, which is not one expertax reads "
                f"({', '.join(_FROM_NAMES)})"
            )
        dtype = _FROM_NAMES[kind]
        if end - begin != nbytes(shape, dtype):
            raise ConfigError(f"{fname}: tensor {name} has {end - begin} bytes, shape {shape}")
        if 8 + length + end > size:
            raise ConfigError(
                f"{fname} is cut off: tensor {name} ends at byte {8 + length + end}, the file has "
                f"{size}"
            )
        out[name] = (dtype, shape, 8 + length + begin)
    return out


Entry = tuple[str, tuple[int, ...], np.dtype]  # name, shape, dtype


def nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def plan_shards(entries: list[Entry], max_shard_bytes: int) -> list[tuple[str, list[Entry]]]:
    """(file name, entries) per shard: at most `max_shard_bytes` each, a tensor never split,
    named as transformers names them."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        n = nbytes(entry[1], entry[2])
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    k = len(shards)
    if k == 1:
        return [(SINGLE_FILE, shards[0])]
    return [(f"model-{i + 1:05d}-of-{k:05d}.safetensors", s) for i, s in enumerate(shards)]


def _header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in entries:
        n = nbytes(shape, dtype)
        header[name] = {
            "dtype": _DTYPE_NAMES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = jsonio.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces


def write_file(
    path: Path,
    entries: list[Entry],
    blocks: Iterable[tuple[str, np.ndarray]],
    *,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write one safetensors file from `blocks`: (tensor name, consecutive rows of it), in
    `entries` order. Written to `path.partial`, renamed to `path` once every byte is there."""
    expected = {name: nbytes(shape, dtype) for name, shape, dtype in entries}
    dtypes = {name: np.dtype(dtype) for name, _, dtype in entries}
    order = [name for name, _, _ in entries]
    written = dict.fromkeys(order, 0)
    tmp = path.with_name(path.name + PARTIAL)
    header = _header(entries, metadata or {"format": "pt"})
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        position = 0
        settled = 0  # bytes of the file on disk and out of the page cache (model_dir.settle)
        for name, block in blocks:
            while position < len(order) and written[order[position]] == expected[order[position]]:
                position += 1
            if position == len(order) or name != order[position]:
                raise ValueError(f"tensor {name} written out of order into {path.name}")
            if block.dtype != dtypes[name]:
                raise ValueError(
                    f"tensor {name}: block dtype {block.dtype}, planned {dtypes[name]}"
                )
            data = np.ascontiguousarray(block)
            if written[name] + data.nbytes > expected[name]:
                raise ValueError(f"tensor {name}: more bytes than its shape holds")
            f.write(memoryview(data.reshape(-1).view(np.uint8).data))
            written[name] += data.nbytes
            if f.tell() - settled >= SETTLE_BYTES:
                f.flush()
                model_dir.settle(f.fileno(), 0, f.tell())
                settled = f.tell()
        short = [n for n in order if written[n] != expected[n]]
        if short:
            raise ValueError(f"{path.name}: tensors {short[:3]} incomplete")
        f.flush()
        model_dir.settle(f.fileno())
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_index(directory: Path, shards: list[tuple[str, list[Entry]]]) -> None:
    weight_map = {name: fname for fname, entries in shards for name, _, _ in entries}
    total = sum(nbytes(s, d) for _, entries in shards for _, s, d in entries)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(jsonio.dumps(index, indent=2) + "\n")


def write(
    directory: str | Path,
    entries: list[Entry],
    produce: Callable[[str], np.ndarray],
    *,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Write tensors `entries`, computing each with `produce(name)`, one tensor in memory at a
    time; with more than one shard an index file is written. Returns the files written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(entries, max_shard_bytes)
    for fname, shard in shards:
        write_file(directory / fname, shard, ((n, produce(n)) for n, _, _ in shard))
    files = [fname for fname, _ in shards]
    if len(shards) > 1:
        write_index(directory, shards)
        files.append(INDEX_FILE)
    return files


def iter_tensors(directory: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every (name, tensor) of a checkpoint directory, in name order (for tests and tools)."""
    with Reader(directory) as r:
        for name in r.names():
            yield name, r.get(name)


def _read_index(index: Path) -> dict[str, str]:
    """The weight map (tensor name -> file) of `model.safetensors.index.json`; ConfigError
    naming the file when it is damaged."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{index} is damaged: not JSON with a weight_map ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ConfigError(f"{index} is damaged: its weight_map is not a mapping of names to files")
    return weight_map
