"""Training on dataset_type=files: checks, per-process rows, exact resume, packed attention."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.conftest import TINY_MOE

from expertax.config import ConfigError
from expertax.models import abstract_params, decoder
from expertax.preflight import load_config
from expertax.train import loop
from expertax.train.inputs import make_data
from expertax.train.trainer import build_trainer

pytestmark = pytest.mark.distributed

# The model of tests/unit/train/test_resume.py (same compiled step through the persistent cache).
TINY = dict(TINY_MOE, steps=20, checkpoint_period=5)


@pytest.fixture(scope="module", autouse=True)
def _cache(persistent_compile_cache):
    yield


def files_config(corpus, tmp_path, **overrides):
    values = {
        **TINY,
        "dataset_type": "files",
        "dataset_path": str(corpus.root),  # JSONL, Parquet and text files (tokenizer.json skipped)
        "tokenizer_path": corpus.tokenizer_path,
        "base_output_directory": str(tmp_path),
        **overrides,
    }
    return load_config(overrides=values)


def test_files_needs_path_and_tokenizer():
    with pytest.raises(
        ConfigError, match="dataset_type=files needs dataset_path and tokenizer_path"
    ):
        load_config(overrides={"dataset_type": "files"})
    with pytest.raises(ConfigError, match="needs tokenizer_path"):
        load_config(overrides={"dataset_type": "files", "dataset_path": "x.jsonl"})


def test_tokenizer_larger_than_vocab_is_refused(corpus, tmp_path):
    n = corpus.tokenizer.get_vocab_size()
    assert 16 < n <= TINY["vocab_size"]
    c = files_config(corpus, tmp_path, vocab_size=16, run_name="r")
    with pytest.raises(ConfigError, match=f"has {n} tokens but vocab_size=16; set vocab_size={n}"):
        loop.train(c, echo=lambda *_: None)
    assert not (tmp_path / "r").exists()  # refused before the run folder is made


def test_each_process_reads_its_rows(corpus, tmp_path, monkeypatch):
    c = files_config(corpus, tmp_path)
    trainer = build_trainer(c)
    batches = []
    for index in range(2):
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        monkeypatch.setattr(jax, "process_index", lambda index=index: index)
        it = make_data(c, trainer)
        batches.append(next(it))
        assert batches[-1]["inputs"].shape == (trainer.global_batch // 2, c.max_target_length)
        state = it.get_state()["config"]
        assert (state["process_index"], state["process_count"]) == (index, 2)
    # Disjoint document shards (tests/unit/data/test_files.py): the two halves differ.
    assert not np.array_equal(batches[0]["inputs"], batches[1]["inputs"])


def test_files_run_resumes_bitwise(corpus, tmp_path):
    quiet = dict(echo=lambda *_: None)
    straight = loop.train(files_config(corpus, tmp_path, run_name="straight"), **quiet)
    loop.train(files_config(corpus, tmp_path, run_name="resumed"), stop_after_step=10, **quiet)
    resumed = loop.train(files_config(corpus, tmp_path, run_name="resumed"), **quiet)
    assert resumed["resumed_from"] == 10
    assert resumed["data_state"] == straight["data_state"]
    assert resumed["data_state"]["pipeline"]  # a real position, not an empty state
    for a, b in zip(
        jax.tree.leaves(resumed["state"]), jax.tree.leaves(straight["state"]), strict=True
    ):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert np.array_equal(np.asarray(a), np.asarray(b))
    losses = [
        [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").open()]
        for name in ("straight", "resumed")
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 20


@pytest.mark.parametrize("model", ["llama-tiny", "deepseek3-tiny"])
def test_packed_documents_do_not_attend_to_each_other(model):
    """d(loss on document 2)/d(inputs of document 1) == 0 with segment ids; != 0 without."""
    c = load_config(
        overrides=dict(
            model_name=model, base_num_decoder_layers=1, first_num_dense_layers=0, vocab_size=64,
            num_experts=4, num_experts_per_tok=2, n_routing_groups=-1, topk_routing_group=-1,
        )
    )  # fmt: skip
    # Random values of the right shapes: cheaper than compiling the initializers, and any
    # non-degenerate weights must keep the documents apart.
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: jnp.asarray(0.2 * rng.standard_normal(s.shape), s.dtype), abstract_params(c)
    )
    t, split = 16, 6
    x_BTD = jax.random.normal(jax.random.key(1), (1, t, c.base_emb_dim))
    segments = jnp.asarray([[1] * split + [2] * (t - split)], jnp.int32)
    positions = jnp.asarray([list(range(split)) + list(range(t - split))], jnp.int32)

    def doc2_loss(x, segment_ids):
        logits, _ = decoder.forward_embedded(
            params, x, c, positions_BT=positions, segment_ids_BT=segment_ids
        )
        return jnp.sum(jnp.where((segments == 2)[..., None], logits, 0.0) ** 2)

    grad_fn = jax.jit(jax.grad(doc2_loss))
    grad = grad_fn(x_BTD, segments)
    assert np.all(np.asarray(grad[:, :split]) == 0)
    assert np.any(np.asarray(grad[:, split:]) != 0)
    # Negative control: one segment over the whole row lets document 2 see document 1.
    grad_one = grad_fn(x_BTD, jnp.ones_like(segments))
    assert np.any(np.asarray(grad_one[:, :split]) != 0)


def test_finite_epochs_end_the_run_with_a_checkpoint(corpus, tmp_path):
    c = files_config(corpus, tmp_path, run_name="epoch", data_num_epochs=1, checkpoint_period=100)
    summary = loop.train(c, echo=lambda *_: None)
    records = (tmp_path / "epoch" / "metrics.jsonl").read_text().splitlines()
    assert 2 <= len(records) < c.steps  # the corpus holds a few batches, not 20
    steps = sorted(p.name for p in (tmp_path / "epoch" / "checkpoints").iterdir() if p.is_dir())
    assert steps == [str(len(records))] and summary["final_loss"] > 0
