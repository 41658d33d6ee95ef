"""Packing tokenized documents into fixed-length rows with segment ids and positions.

`PackIterDataset` turns a stream of documents (int32 token arrays) into rows of `seq_len` tokens:
documents are laid end to end in stream order; a document that does not fit is split, and its rest
starts the next row. Each row is built from `seq_len + 1` packed tokens and shifted by one:

    inputs  = packed[:-1]          targets = packed[1:]
    weights = 1 where the input token and its target belong to the same document chunk, else 0

A split document repeats one token: the last token of a row (a target only) is the first input of
the next row, so every next-token pair inside a document is trained exactly once. Positions restart
at 0 in each row (a continuation chunk is a new segment), which keeps them below `seq_len`.

The iterator state is the parent's state *before* the document being packed was read, plus the
offset into that document: restoring re-reads that one document, so the state stays a few integers.
"""

from __future__ import annotations

import copy
from typing import Any

import grain
import numpy as np

# Keys of one packed row (and of a batch, with a leading batch axis).
ROW_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


def empty_row(seq_len: int) -> dict[str, np.ndarray]:
    """An all-padding row: zero tokens, segment 0, weight 0."""
    row = {k: np.zeros((seq_len,), np.int32) for k in ROW_KEYS}
    row["weights"] = np.zeros((seq_len,), np.float32)
    return row


def shift_row(
    tokens_W: np.ndarray, segments_W: np.ndarray, positions_W: np.ndarray
) -> dict[str, np.ndarray]:
    """(inputs, targets, …) of length W-1 from W packed tokens; targets are 0 where weight is 0."""
    same_doc = (segments_W[:-1] == segments_W[1:]) & (segments_W[:-1] > 0)
    return {
        "inputs": tokens_W[:-1],
        "targets": np.where(same_doc, tokens_W[1:], 0).astype(np.int32),
        "segment_ids": segments_W[:-1],
        "positions": positions_W[:-1],
        "weights": same_doc.astype(np.float32),
    }


class _PackDatasetIterator(grain.DatasetIterator):
    """Packs documents from `parent` into rows; see the module docstring."""

    def __init__(self, parent: grain.DatasetIterator, seq_len: int):
        super().__init__(parent)
        self._window = seq_len + 1
        self._doc: np.ndarray | None = None  # the document being packed
        self._doc_state: dict[str, Any] | None = None  # parent state before `_doc` was read
        self._offset = 0  # first token of `_doc` not yet used as an input
        self._exhausted = False

    def _next_document(self) -> bool:
        """Reads documents until one has >= 2 tokens (shorter ones predict nothing)."""
        while not self._exhausted:
            state = copy.deepcopy(self._parent.get_state())
            try:
                doc = next(self._parent)
            except StopIteration:
                self._exhausted = True
                return False
            if len(doc) >= 2:
                self._doc, self._doc_state, self._offset = doc, state, 0
                return True
        return False

    def __next__(self) -> dict[str, np.ndarray]:
        window = self._window
        tokens = np.zeros((window,), np.int32)
        segments = np.zeros((window,), np.int32)
        positions = np.zeros((window,), np.int32)
        fill, segment = 0, 0
        # A chunk needs two slots to hold one (input, target) pair.
        while window - fill >= 2:
            if self._doc is None and not self._next_document():
                break
            doc, offset = self._doc, self._offset
            assert doc is not None  # _next_document() set it
            take = min(len(doc) - offset, window - fill)
            segment += 1
            tokens[fill : fill + take] = doc[offset : offset + take]
            segments[fill : fill + take] = segment
            positions[fill : fill + take] = np.arange(take, dtype=np.int32)
            fill += take
            if offset + take == len(doc):
                self._doc, self._doc_state = None, None
            else:  # the row is full; its last token is re-used as the next row's first input
                self._offset = offset + take - 1
        if fill == 0:
            raise StopIteration
        return shift_row(tokens, segments, positions)

    def get_state(self) -> dict[str, Any]:
        if self._doc is None:
            return {"parent": copy.deepcopy(self._parent.get_state()), "doc_offset": -1}
        return {"parent": copy.deepcopy(self._doc_state), "doc_offset": self._offset}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(copy.deepcopy(state["parent"]))
        self._doc, self._doc_state, self._offset = None, None, 0
        self._exhausted = False
        if state["doc_offset"] >= 0:
            self._doc_state = copy.deepcopy(state["parent"])
            self._doc = next(self._parent)
            self._offset = int(state["doc_offset"])


class PackIterDataset(grain.IterDataset):
    """Rows of `seq_len` tokens packed from a dataset of int32 documents (1-D arrays).

    Each element is a dict of [seq_len] arrays: `inputs`, `targets`, `segment_ids` (1, 2, … per
    chunk, 0 = padding), `positions` (restarting at 0 per chunk) int32 and `weights` float32.
    """

    def __init__(self, parent: grain.IterDataset, seq_len: int):
        super().__init__(parent)
        if seq_len < 1:
            raise ValueError(f"max_target_length={seq_len} must be >= 1.")
        self._seq_len = seq_len

    def __iter__(self) -> _PackDatasetIterator:
        return _PackDatasetIterator(self._parent.__iter__(), self._seq_len)

    def __str__(self) -> str:
        return f"PackIterDataset(seq_len={self._seq_len})"
