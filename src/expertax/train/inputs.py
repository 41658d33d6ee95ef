"""The training data of a run: its checks, this process's batch iterator, its saved position.

`make_data` builds the iterator (and so checks the data paths, the tokenizer and the text field)
without writing anything, which is why the train loop calls it before it opens the run folder.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from jax.experimental import multihost_utils

from expertax.config.schema import Config
from expertax.data import files, tokenizer
from expertax.data.synthetic import SyntheticData
from expertax.errors import ConfigError
from expertax.train.trainer import Trainer


def check_tokenizer_vocab(c: Config) -> None:
    """The tokenizer's ids must fit the embedding: its vocabulary size <= vocab_size."""
    try:
        tok = tokenizer.load_tokenizer(c.tokenizer_path)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > c.vocab_size:
        raise ConfigError(
            f"tokenizer_path={c.tokenizer_path!r} has {n} tokens but vocab_size={c.vocab_size}; "
            f"set vocab_size={n} or more (the model must embed every token id)"
        )


# The held-out synthetic stream: seed data_shuffle_seed + this (a stream the run never trains on).
EVAL_SEED_OFFSET = 1_000_003


def check_rollout_fields(c: Config) -> None:
    """The train loop's data (synthetic, files) carries no recorded routing and no advantages:
    routing_replay and token_advantages are driven from an RL loop through the library
    (data/rollouts.py builds the batches; examples/rl_routing_replay.py)."""
    for key in ("routing_replay", "token_advantages"):
        if getattr(c, key):
            raise ConfigError(
                f"{key}=true: dataset_type={c.dataset_type} has no per-sequence rollouts "
                "(recorded routing, advantages); drive the train step from an RL loop with "
                "batches of expertax.data.rollouts (examples/rl_routing_replay.py), or set "
                f"{key}=false"
            )


def make_data(c: Config, trainer: Trainer):
    """This process's batch iterator: rows global_batch / process_count, its share of the batch."""
    check_rollout_fields(c)
    seed, epochs = c.data_shuffle_seed, None if c.data_num_epochs == -1 else c.data_num_epochs
    return _iterator(c, trainer, c.dataset_type, c.dataset_path, seed, epochs)


def make_eval_data(c: Config, trainer: Trainer):
    """The held-out iterator of the evaluation: eval_dataset_path's files (tokenized and packed
    on their own, repeated as needed), or a synthetic stream with another seed than training's."""
    if c.eval_dataset_path:
        return _iterator(c, trainer, "files", c.eval_dataset_path, c.data_shuffle_seed, None)
    seed = c.data_shuffle_seed + EVAL_SEED_OFFSET
    return _iterator(c, trainer, "synthetic", "", seed, None)


def _iterator(c: Config, trainer: Trainer, kind: str, path: str, seed: int, epochs: int | None):
    count, index = jax.process_count(), jax.process_index()
    if trainer.global_batch % count:
        raise ConfigError(
            f"the global batch {trainer.global_batch} (per_device_batch_size="
            f"{c.per_device_batch_size}) does not split evenly over {count} processes"
        )
    rows = trainer.global_batch // count
    if kind == "files":
        try:
            return files.make_file_iterator(
                dataset_path=path,
                tokenizer_path=c.tokenizer_path,
                text_field=c.data_text_field,
                seq_len=c.max_target_length,
                batch_size=rows,
                seed=seed,
                process_index=index,
                process_count=count,
                num_epochs=epochs,
                worker_count=c.data_worker_count,
            )
        except ValueError as e:
            msg = str(e)
            if path != c.dataset_path:  # the files' checks name dataset_path
                msg = msg.replace("dataset_path=", "eval_dataset_path=")
            raise ConfigError(msg) from None
    return SyntheticData(
        vocab_size=c.vocab_size,
        seq_len=c.max_target_length,
        global_batch=trainer.global_batch,
        seed=seed,
        row_start=rows * index,
        rows=rows,
        noise=c.synthetic_noise,
    )


def check_first_batch(data, what: str = "the training data") -> None:
    """Read the first batch of a file iterator and rewind it: documents are read and tokenized
    only as batches are drawn, so a bad record or a text the tokenizer refuses would otherwise
    stop the run after its folder is written. Synthetic data cannot fail and is not read."""
    if isinstance(data, SyntheticData):
        return
    start = data.get_state()
    try:
        next_batch(data, f"the first batch of {what}")
    except StopIteration:
        pass
    data.set_state(start)


def next_batch(data, where: str) -> dict:
    """The next batch of `data`; a document that cannot be read or tokenized is a ConfigError
    naming `where` (StopIteration passes: finite data ends)."""
    try:
        return next(data)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def _allgather_json(obj) -> list:
    """Every process's JSON-serialisable `obj`, in process order (a collective: all must call)."""
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(raw.size))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(bytes(r[:n]).decode()) for r, n in zip(rows, lengths)]


def data_state(c: Config, trainer: Trainer, data, skipped_steps: int) -> dict:
    """The JSON item saved with each checkpoint: the data position(s) and loop counters.

    Synthetic data is a function of the step, the same on every process; a file iterator's
    position differs per process (each reads its own documents), so all positions are gathered.
    """
    it_state = data.get_state()
    if c.dataset_type == "files" and jax.process_count() > 1:
        iterators = _allgather_json(it_state)
    else:
        iterators = [it_state]
    return {
        "dataset_type": c.dataset_type,
        "global_batch": trainer.global_batch,
        "skipped_steps": skipped_steps,
        "iterators": iterators,
    }
