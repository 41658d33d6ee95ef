"""Reading and writing (sharded) safetensors one tensor at a time.

A checkpoint directory holds either `model.safetensors`, or shards listed in
`model.safetensors.index.json` (`{"metadata": {...}, "weight_map": {name: file}}`), the layout
transformers writes. Reading memory-maps each file and copies out one tensor per call; writing
holds one shard at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class Reader:
    """Tensor names and values of an HF checkpoint directory (single file or sharded)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        self._stack = ExitStack()
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.directory / SINGLE_FILE).is_file():
            with safe_open(self.directory / SINGLE_FILE, "numpy") as f:
                weight_map = {name: SINGLE_FILE for name in f.keys()}
        else:
            raise FileNotFoundError(f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.weight_map: dict[str, str] = dict(weight_map)
        self._files: dict[str, object] = {}

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def _file(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._files:
            self._files[fname] = self._stack.enter_context(
                safe_open(self.directory / fname, "numpy")
            )
        return self._files[fname]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """One tensor as a numpy array (bfloat16 as ml_dtypes.bfloat16)."""
        return self._file(name).get_tensor(name)

    def close(self) -> None:
        self._stack.close()
        self._files.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write(
    directory: str | Path,
    entries: list[tuple[str, tuple[int, ...], np.dtype]],
    produce: Callable[[str], np.ndarray],
    *,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Write tensors `entries` (name, shape, dtype), computing each with `produce(name)`.

    Shards are planned from the shapes first (at most `max_shard_bytes` each, one tensor never
    split), then filled one at a time; with more than one shard an index file is written, named
    as transformers names them. Returns the files written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, int]]] = [[]]
    size = 0
    for name, shape, dtype in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, nbytes))
        size += nbytes
    n = len(shards)
    files = (
        [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for fname, shard in zip(files, shards):
        tensors = {name: np.ascontiguousarray(produce(name)) for name, _ in shard}
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        for name, nbytes in shard:
            weight_map[name] = fname
            total += nbytes
        del tensors
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX_FILE)
    return files


def iter_tensors(directory: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every (name, tensor) of a checkpoint directory, in name order (for tests and tools)."""
    with Reader(directory) as r:
        for name in r.names():
            yield name, r.get(name)
