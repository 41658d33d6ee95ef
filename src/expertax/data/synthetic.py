"""Synthetic data: learnable arithmetic sequences, a pure function of (seed, step, row).

Each sequence is x_t = (a + b*t) mod V with a, b drawn per sequence, so a model can learn to
continue it from context and the loss falls. Any process can make any row: multi-process runs
and resumes give exactly the same global batches.

Its text is the numbers themselves (`number_tokenizer`): token id i is the word "i", so a run
trained on it reads the prompt "3 5 7 9 11" and writes "13 15 17 ..." (`expertax generate`).
"""

from __future__ import annotations

import numpy as np
import tokenizers
from tokenizers import models, pre_tokenizers

# The word the number tokenizer stands for anything that is not a whole number below the
# vocabulary size; it is not in the vocabulary, so encoding such a word is refused.
NOT_A_NUMBER = "<not a number>"


def number_tokenizer(vocab_size: int) -> tokenizers.Tokenizer:
    """A `tokenizers` word-level tokenizer of the synthetic data's text: id i <-> the word "i"
    (0 .. vocab_size - 1), words split on whitespace, decoded joined by spaces; no special
    tokens (the synthetic sequences have no BOS or EOS)."""
    vocab = {str(i): i for i in range(vocab_size)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=NOT_A_NUMBER))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


class SyntheticData:
    """Batches of `rows` sequences (the rows `row_start..row_start+rows` of the global batch)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        global_batch: int,
        seed: int,
        row_start: int = 0,
        rows: int | None = None,
    ):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.global_batch = global_batch
        self.row_start = row_start
        self.rows = global_batch if rows is None else rows
        self.step = 0

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, step])
        a = rng.integers(0, self.vocab_size, size=self.global_batch)
        b = rng.integers(1, 8, size=self.global_batch)
        sl = slice(self.row_start, self.row_start + self.rows)
        t = np.arange(self.seq_len + 1)
        seq = (a[sl, None] + b[sl, None] * t[None, :]) % self.vocab_size
        seq = seq.astype(np.int32)
        shape = (self.rows, self.seq_len)
        return {
            "inputs": seq[:, :-1],
            "targets": seq[:, 1:],
            "segment_ids": np.ones(shape, np.int32),
            "positions": np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), shape).copy(),
            "weights": np.ones(shape, np.float32),
        }

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])
