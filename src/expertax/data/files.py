"""`dataset_type=files`: local JSONL / Parquet / text files → packed, shuffled, sharded batches.

Pipeline (Grain; docs/design/data.md):

    DocumentSource (random access to every document of every matched file, in sorted file order)
      → [process_index::process_count]     shard documents across processes (disjoint)
      → shuffle(seed) → repeat(num_epochs)   a new permutation each epoch
      → map(tokenize)                        [BOS] ids [EOS], int32
      → to_iter_dataset(worker_count threads; output independent of the thread count)
      → PackIterDataset(seq_len)             rows with segment ids / positions / weights
      → batch(batch_size)                    the last, short batch is padded with empty rows

Inputs: `*.jsonl` (one JSON object per line, text under `data_text_field`), `*.parquet`
(column `data_text_field`), `*.txt` / `*.md` (one document per file). `dataset_path` is a file, a
directory (searched recursively for those extensions) or a glob.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import threading
from typing import Any

import grain
import numpy as np
import pyarrow.parquet as pq

from expertax.data import packing, tokenizer

JSONL_SUFFIXES = (".jsonl",)  # not ".json": a tokenizer.json or config.json is not data
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".md")
SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES
STATE_VERSION = 1


def find_files(dataset_path: str) -> list[str]:
    """The sorted data files named by `dataset_path` (a file, a directory or a glob)."""
    if os.path.isfile(dataset_path):
        if not dataset_path.endswith(SUFFIXES):
            raise ValueError(
                f"dataset_path={dataset_path!r} has an unsupported extension; "
                f"supported: {', '.join(SUFFIXES)}."
            )
        return [dataset_path]
    if os.path.isdir(dataset_path):
        candidates = glob.glob(os.path.join(dataset_path, "**", "*"), recursive=True)
    else:
        candidates = glob.glob(dataset_path, recursive=True)
    files = sorted(p for p in candidates if os.path.isfile(p) and p.endswith(SUFFIXES))
    if not files:
        raise ValueError(
            f"dataset_path={dataset_path!r} matches no data files; give a file, a directory or a "
            f"glob matching files ending in {', '.join(SUFFIXES)}."
        )
    return files


def _missing_field(path: str, where: str, text_field: str, found: list[str]) -> ValueError:
    return ValueError(
        f"data_text_field={text_field!r} not found in {path} ({where}); "
        f"available fields: {sorted(found)}. Set data_text_field to one of them."
    )


def _jsonl_offsets(path: str, text_field: str) -> np.ndarray:
    """Byte offsets of the non-blank lines; checks the first record has `text_field`."""
    offsets, pos, first = [], 0, None
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                offsets.append(pos)
                if first is None:
                    first = line
            pos += len(line)
    if first is not None:
        record = _parse_jsonl_line(path, 1, first)
        if text_field not in record:
            raise _missing_field(path, "first record", text_field, list(record))
    return np.asarray(offsets, np.int64)


def _parse_jsonl_line(path: str, index: int, line: bytes) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"dataset_path: {path} record {index} is not valid JSON ({e}).") from e
    if not isinstance(record, dict):
        raise ValueError(f"dataset_path: {path} record {index} is not a JSON object.")
    return record


class DocumentSource:
    """Random access (`len`, `[i]` → str) to the documents of `files`, in file order.

    JSONL files are indexed by line offsets (one pass, the texts stay on disk); Parquet files are
    read one row group at a time (a small cache keeps recent ones); text files are read whole.
    """

    def __init__(self, files: list[str], text_field: str, cached_row_groups: int = 4):
        self._files = files
        self._text_field = text_field
        self._kinds: list[str] = []
        self._index: list[Any] = []  # per file: jsonl offsets / parquet row-group starts / None
        counts = []
        for path in files:
            kind, index, count = self._index_file(path)
            self._kinds.append(kind)
            self._index.append(index)
            counts.append(count)
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_size = cached_row_groups
        self._lock = threading.Lock()

    def _index_file(self, path: str) -> tuple[str, Any, int]:
        if path.endswith(JSONL_SUFFIXES):
            offsets = _jsonl_offsets(path, self._text_field)
            return "jsonl", offsets, len(offsets)
        if path.endswith(PARQUET_SUFFIXES):
            meta = pq.ParquetFile(path)
            names = meta.schema_arrow.names
            if self._text_field not in names:
                raise _missing_field(path, "Parquet columns", self._text_field, names)
            rows = [meta.metadata.row_group(g).num_rows for g in range(meta.num_row_groups)]
            return "parquet", np.concatenate([[0], np.cumsum(rows, dtype=np.int64)]), sum(rows)
        return "text", None, 1

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> str:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} out of range [0, {len(self)})")
        file_idx = int(np.searchsorted(self._starts, index, side="right")) - 1
        local = index - int(self._starts[file_idx])
        path, kind = self._files[file_idx], self._kinds[file_idx]
        if kind == "text":
            try:
                with open(path, encoding="utf-8") as f:
                    return f.read()
            except UnicodeDecodeError as e:
                raise ValueError(f"dataset_path: {path} is not UTF-8 text ({e}).") from e
        if kind == "jsonl":
            return self._read_jsonl(path, self._index[file_idx], local)
        return self._read_parquet(file_idx, local)

    def _read_jsonl(self, path: str, offsets: np.ndarray, local: int) -> str:
        with open(path, "rb") as f:
            f.seek(int(offsets[local]))
            record = _parse_jsonl_line(path, local + 1, f.readline())
        if self._text_field not in record:
            raise _missing_field(path, f"record {local + 1}", self._text_field, list(record))
        return _as_text(record[self._text_field])

    def _read_parquet(self, file_idx: int, local: int) -> str:
        group_starts = self._index[file_idx]
        group = int(np.searchsorted(group_starts, local, side="right")) - 1
        key = (file_idx, group)
        with self._lock:
            texts = self._cache.get(key)
            if texts is not None:
                self._cache.move_to_end(key)
        if texts is None:
            table = pq.ParquetFile(self._files[file_idx]).read_row_group(
                group, columns=[self._text_field]
            )
            texts = table.column(0).to_pylist()
            with self._lock:
                self._cache[key] = texts
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return _as_text(texts[local - int(group_starts[group])])


def _as_text(value: Any) -> str:
    """None (a null cell) is an empty document; anything else must be a string."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"data_text_field values must be strings, got {type(value).__name__}.")
    return value


class FileBatchIterator:
    """Batches of packed rows: a dict of [batch_size, seq_len] numpy arrays.

    Keys: `inputs`, `targets`, `segment_ids`, `positions` (int32) and `weights` (float32); see
    `expertax.data.packing`. `get_state()` returns a JSON-serialisable dict; `set_state` restores
    the exact position, so the next batches are identical.
    """

    def __init__(self, dataset: grain.IterDataset, *, batch_size: int, seq_len: int, config: dict):
        self._iterator = iter(dataset)
        self._batch_size = batch_size
        self._seq_len = seq_len
        self._config = config

    def __iter__(self) -> FileBatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._iterator)
        short = self._batch_size - batch["inputs"].shape[0]
        if short:  # the last batch of a finite run: pad with empty rows, keep the shape static
            pad = packing.empty_row(self._seq_len)
            batch = {
                k: np.concatenate([v, np.broadcast_to(pad[k], (short, self._seq_len))])
                for k, v in batch.items()
            }
        return batch

    def get_state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "config": dict(self._config),
            "pipeline": _to_builtin(self._iterator.get_state()),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"data iterator state version {state.get('version')!r} is not {STATE_VERSION}."
            )
        if state.get("config") != self._config:
            raise ValueError(
                f"data iterator state was saved with {state.get('config')}, but this iterator has "
                f"{self._config}; resume with the same dataset_path, seed, max_target_length, "
                "batch size and process layout."
            )
        self._iterator.set_state(state["pipeline"])


def _to_builtin(obj: Any) -> Any:
    """Numpy scalars in a state tree → Python ints/floats (so `json.dumps` works)."""
    if isinstance(obj, dict):
        return {k: _to_builtin(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_to_builtin(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _check_arguments(
    seq_len: int, batch_size: int, seed: int, process_index: int, process_count: int,
    num_epochs: int | None, worker_count: int,
) -> None:  # fmt: skip
    if seq_len < 1:
        raise ValueError(f"max_target_length={seq_len} must be >= 1.")
    if batch_size < 1:
        raise ValueError(f"batch size {batch_size} must be >= 1.")
    if not 0 <= seed < 2**32:
        raise ValueError(f"data_shuffle_seed={seed} must be in [0, 2**32).")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} must be in [0, {process_count}).")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(
            f"data_num_epochs={num_epochs}: use -1 (repeat the files forever) or a count >= 1"
        )
    if worker_count < 0:
        raise ValueError(f"worker_count={worker_count} must be >= 0.")


def make_file_iterator(
    *,
    dataset_path: str,
    tokenizer_path: str,
    text_field: str,
    seq_len: int,
    batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    num_epochs: int | None = None,
    worker_count: int = 0,
) -> FileBatchIterator:
    """The batches this process trains on, from local files; see the module docstring.

    Args:
      dataset_path: a file, a directory or a glob of .jsonl/.parquet/.txt/.md files.
      tokenizer_path: a HuggingFace `tokenizer.json` (or a directory containing one).
      text_field: the JSONL key / Parquet column holding the text (`data_text_field`).
      seq_len: tokens per row (`max_target_length`).
      batch_size: rows per batch on this process.
      seed: shuffle seed; each epoch is permuted differently.
      process_index, process_count: this process's share of the documents (disjoint shards).
      num_epochs: passes over the data; None repeats forever.
      worker_count: threads reading and tokenizing documents ahead; 0 reads in the caller's thread.
        The batches do not depend on it.
    """
    _check_arguments(
        seq_len, batch_size, seed, process_index, process_count, num_epochs, worker_count
    )
    files = find_files(dataset_path)
    encode = tokenizer.DocumentEncoder.from_tokenizer(tokenizer.load_tokenizer(tokenizer_path))
    source = DocumentSource(files, text_field)
    docs = grain.MapDataset.source(source)[process_index::process_count]
    if len(docs) == 0:
        raise ValueError(
            f"dataset_path={dataset_path!r} has {len(source)} documents, too few for "
            f"process_index={process_index} of process_count={process_count}."
        )
    # Grain permutes epoch e with seed + e, so seeds 0 and 1 would share permutations one epoch
    # apart; hashing the seed first makes nearby seeds unrelated.
    shuffle_seed = int(np.random.SeedSequence(seed).generate_state(1)[0])
    docs = docs.shuffle(shuffle_seed).repeat(num_epochs).map(encode)
    read = grain.ReadOptions(num_threads=worker_count, prefetch_buffer_size=4 * worker_count)
    rows = packing.PackIterDataset(docs.to_iter_dataset(read), seq_len)
    batches = rows.batch(batch_size, drop_remainder=False)
    config = {
        "files": len(files),
        "documents": len(source),
        "seed": seed,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "process_index": process_index,
        "process_count": process_count,
        "num_epochs": num_epochs,
    }
    return FileBatchIterator(batches, batch_size=batch_size, seq_len=seq_len, config=config)
