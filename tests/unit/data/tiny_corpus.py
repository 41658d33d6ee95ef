"""A tiny corpus and a tokenizer trained on it, written to a temporary directory (no downloads)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

WORDS = [f"w{i}" for i in range(40)]
BOS, EOS = "<s>", "</s>"


def make_documents(count: int, seed: int) -> list[str]:
    """Documents of 1..40 space-separated words (some longer than a row, some a single word)."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(count):
        n = int(rng.integers(1, 41))
        words = [WORDS[j] for j in rng.integers(0, len(WORDS), size=n)]
        docs.append(f"d{i} " + " ".join(words))  # a unique first word: every document differs
    return docs


def train_tokenizer(path: pathlib.Path, texts: list[str], specials: list[str]) -> str:
    """A WordLevel tokenizer split on whitespace; decoding joins words with single spaces."""
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", *specials])
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return str(path)


class Corpus:
    """The same documents as JSONL (two files, one nested), Parquet (row groups of 5) and text."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.jsonl_docs = make_documents(30, seed=0)
        self.parquet_docs = [f"p{d}" for d in make_documents(23, seed=1)]
        self.text_docs = [f"t{d}" for d in make_documents(7, seed=2)]
        all_docs = self.jsonl_docs + self.parquet_docs + self.text_docs
        (root / "tok").mkdir()
        self.tokenizer_path = train_tokenizer(root / "tok" / "tokenizer.json", all_docs, [BOS, EOS])
        self.tokenizer = tokenizers.Tokenizer.from_file(self.tokenizer_path)

        (root / "jsonl" / "nested").mkdir(parents=True)
        self._write_jsonl(root / "jsonl" / "a.jsonl", self.jsonl_docs[:18])
        self._write_jsonl(root / "jsonl" / "nested" / "b.jsonl", self.jsonl_docs[18:])
        (root / "jsonl" / "README").write_text("not data: no supported extension\n")

        (root / "parquet").mkdir()
        table = pa.table({"id": list(range(23)), "text": self.parquet_docs})
        pq.write_table(table, root / "parquet" / "docs.parquet", row_group_size=5)

        (root / "text").mkdir()
        for i, doc in enumerate(self.text_docs):
            (root / "text" / f"doc{i:02d}.txt").write_text(doc)

    @staticmethod
    def _write_jsonl(path: pathlib.Path, docs: list[str]) -> None:
        lines = [json.dumps({"text": d, "meta": {"n": i}}) for i, d in enumerate(docs)]
        # A blank line in the middle is skipped, not a document.
        path.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")

    @property
    def all_docs(self) -> list[str]:
        return self.jsonl_docs + self.parquet_docs + self.text_docs

    def encode(self, doc: str) -> list[int]:
        """The ids the pipeline should produce for one document: [BOS] words [EOS]."""
        ids = self.tokenizer.encode(doc, add_special_tokens=False).ids
        return [self.tokenizer.token_to_id(BOS), *ids, self.tokenizer.token_to_id(EOS)]
