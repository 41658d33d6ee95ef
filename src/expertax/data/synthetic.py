"""Synthetic data: learnable arithmetic sequences, a pure function of (seed, step, row).

Each sequence is x_t = (a + b*t) mod V with a, b drawn per sequence, so a model can learn to
continue it from context and the loss falls. Any process can make any row: multi-process runs
and resumes give exactly the same global batches.

With `noise` = p > 0 each target token is, with probability p, replaced by a token drawn
uniformly from the vocabulary (the inputs stay the clean sequence). The data then has an entropy
floor: the best prediction of a target is the mixture q = (1 - p) on the sequence's next token
plus p/V on every token (V = vocab_size), whose expected cross-entropy (nats) is

    H(p, V) = -(1 - p + p/V) ln(1 - p + p/V) - (V - 1) (p/V) ln(p/V)

(`loss_floor`; about p ln V + H_2(p) for large V, H_2 the binary entropy), the loss a model
that knows every sequence converges to, instead of 0. The first target of a sequence (before
its step b can be read off) is not fully predictable, so a run's loss stays a little above H.
The floor is what makes two runs comparable late in training: a memorized stream's loss goes
to 0 and any difference between runs is large relative to it, while near H the loss measures
the same irreducible term in both. The replacement is a pure function of (seed, step, row) too.

Its text is the numbers themselves (`number_tokenizer`): token id i is the word "i", so a run
trained on it reads the prompt "3 5 7 9 11" and writes "13 15 17 ..." (`expertax generate`).
"""

from __future__ import annotations

import math

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


def loss_floor(noise: float, vocab_size: int) -> float:
    """The entropy (nats) of a target token under `noise`: the cross-entropy of the mixture
    (1 - noise) on the right token + noise/vocab_size on each token against itself."""
    if noise == 0:
        return 0.0
    right, other = 1 - noise + noise / vocab_size, noise / vocab_size
    return -right * math.log(right) - (vocab_size - 1) * other * math.log(other)


class SyntheticData:
    """Batches of `rows` sequences (the rows `row_start..row_start+rows` of the global batch);
    with `noise` > 0 each target token is replaced by a uniform random one with that probability
    (the module docstring)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        global_batch: int,
        seed: int,
        row_start: int = 0,
        rows: int | None = None,
        noise: float = 0.0,
    ):
        self.vocab_size, self.seq_len, self.seed, self.noise = vocab_size, seq_len, seed, noise
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
        targets = seq[:, 1:]
        if self.noise:
            targets = self._noisy(step, targets)
        return {
            "inputs": seq[:, :-1],
            "targets": targets,
            "segment_ids": np.ones(shape, np.int32),
            "positions": np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), shape).copy(),
            "weights": np.ones(shape, np.float32),
        }

    def _noisy(self, step: int, targets: np.ndarray) -> np.ndarray:
        """`targets` with each token replaced, with probability `noise`, by a uniform one; row r
        of the global batch draws from its own generator (seed, step, r), so a process making
        any share of the batch makes the same rows."""
        out = targets.copy()
        for i in range(self.rows):
            rng = np.random.default_rng([self.seed, step, self.row_start + i])
            replace = rng.random(self.seq_len) < self.noise
            uniform = rng.integers(0, self.vocab_size, size=self.seq_len, dtype=np.int32)
            out[i] = np.where(replace, uniform, out[i])
        return out

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
