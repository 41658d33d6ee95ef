"""train(): every check of the user's input runs before the run folder is written.

Each refusal kind is tried on a fresh output folder, which must stay empty (not even a run
folder with a config.yml); the same config with the fault fixed starts (negative control).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import tokenizers
from tests.conftest import TINY_MOE
from tests.unit.data.tiny_corpus import Corpus
from tokenizers import models, pre_tokenizers

from expertax.config import ConfigError
from expertax.data import files
from expertax.preflight import load_config
from expertax.train import model_dir
from expertax.train.loop import prepare, train

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    return Corpus(tmp_path_factory.mktemp("corpus"))


def config(out, **overrides):
    return load_config(overrides={**TINY_MOE, "base_output_directory": str(out), **overrides})


def files_keys(corpus: Corpus, **overrides) -> dict:
    keys = dict(
        dataset_type="files",
        dataset_path=str(corpus.root / "jsonl"),
        tokenizer_path=corpus.tokenizer_path,
        vocab_size=128,
    )
    return {**keys, **overrides}


def refusals(corpus: Corpus, tmp_path) -> dict[str, tuple[dict, str]]:
    """Refusal kind -> (overrides, a pattern of its message)."""
    return {
        "data path": (files_keys(corpus, dataset_path="/no/such/path"), "dataset_path="),
        "data field": (files_keys(corpus, data_text_field="body"), "body"),
        "tokenizer": (files_keys(corpus, tokenizer_path=str(tmp_path / "no-tok")), "tokenizer"),
        "vocabulary": (files_keys(corpus, vocab_size=8), "vocab_size=8"),
        "model directory": (
            dict(load_parameters_path=str(tmp_path / "no-model")),
            "load_parameters_path=",
        ),
        "mesh": (dict(ici_expert_parallelism=3), r"ici_\w+_parallelism"),
    }


@pytest.mark.parametrize(
    "kind", ["data path", "data field", "tokenizer", "vocabulary", "model directory", "mesh"]
)
def test_a_refused_run_leaves_nothing_behind(kind, corpus, tmp_path):
    overrides, pattern = refusals(corpus, tmp_path)[kind]
    out = tmp_path / "runs"
    with pytest.raises(ConfigError, match=pattern):
        train(config(out, **overrides), echo=lambda *_: None)
    assert not out.exists() or os.listdir(out) == [], os.listdir(out)


LAZY = ["bad record", "text the tokenizer refuses", "held-out record", "model parameters"]


def lazily_read_fault(kind: str, corpus: Corpus, tmp_path) -> tuple[dict, str]:
    """Inputs read only as training goes (documents, their tokens, the parameters' arrays), which
    once failed after the run folder was written: (overrides, a pattern of the refusal)."""
    bad = tmp_path / "bad" / "docs.jsonl"
    bad.parent.mkdir()
    bad.write_text(json.dumps({"text": corpus.jsonl_docs[0]}) + "\n{not json\n")
    if kind == "bad record":
        return files_keys(corpus, dataset_path=str(bad)), "first batch .* record 2 is not valid"
    if kind == "text the tokenizer refuses":
        vocab = {"<s>": 0, "</s>": 1, "w1": 2}  # no unknown token: other words cannot be encoded
        tok = tokenizers.Tokenizer(models.WordLevel(vocab))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(tmp_path / "tok.json"))
        return files_keys(corpus, tokenizer_path=str(tmp_path / "tok.json")), "cannot encode"
    if kind == "held-out record":
        keys = files_keys(corpus, eval_interval=2, eval_dataset_path=str(bad))
        return keys, "first batch of the evaluation data: .* record 2 is not valid"
    c = config(tmp_path, run_name="m")
    model_dir.save(tmp_path / "model", c, _zeros_params(c), source="test")
    leaf = next(p for p in (tmp_path / "model" / "params").iterdir() if p.name[0].isalpha())
    shutil.rmtree(leaf)  # a parameter's arrays gone
    keys = dict(load_parameters_path=str(tmp_path / "model"))
    return keys, "load_parameters_path=.*cannot be read"


@pytest.mark.parametrize("kind", LAZY)
def test_inputs_read_lazily_are_refused_before_the_first_write(kind, corpus, tmp_path):
    overrides, pattern = lazily_read_fault(kind, corpus, tmp_path)
    out = tmp_path / "runs"
    with pytest.raises(ConfigError, match=pattern):
        train(config(out, **overrides), echo=lambda *_: None)
    assert not out.exists() or os.listdir(out) == [], os.listdir(out)


def test_the_same_configs_fixed_are_accepted(corpus, tmp_path):
    """Negative control of the refusals: with the fault fixed, the run folder opens."""
    c = config(tmp_path, run_name="m")
    model_dir.save(tmp_path / "model", c, _zeros_params(c), source="test")
    fixed = [
        files_keys(corpus),
        dict(load_parameters_path=str(tmp_path / "model")),
        dict(ici_expert_parallelism=4),
    ]
    for i, overrides in enumerate(fixed):
        p = prepare(config(tmp_path / "runs", run_name=f"r{i}", **overrides))
        p.run.close()
        assert (p.run.path / "config.yml").is_file()


def test_a_folder_holding_another_run_is_left_as_it_was(tmp_path):
    p = prepare(config(tmp_path, run_name="r"))
    p.run.close()
    before = sorted(os.listdir(p.run.path))
    saved = (p.run.path / "config.yml").read_text()
    (p.run.path / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    with pytest.raises(ConfigError, match="base_emb_dim: 64 -> 32"):
        train(config(tmp_path, run_name="r", base_emb_dim=32), echo=lambda *_: None)
    assert sorted(os.listdir(p.run.path)) == sorted([*before, "metrics.jsonl"])
    assert (p.run.path / "config.yml").read_text() == saved


def _zeros_params(c):
    import jax
    import numpy as np

    from expertax.models import decoder
    from expertax.nn.param import is_spec

    return jax.tree.map(lambda s: np.zeros(s.shape, np.float32), decoder.spec(c), is_leaf=is_spec)


def _second_batch_fails(corpus: Corpus, dataset_path: str) -> int:
    """A data_shuffle_seed under which the first batch of `dataset_path` reads and the second
    reaches its bad record (so the run fails at step 1, after its folder was written)."""
    for seed in range(20):
        it = files.make_file_iterator(
            dataset_path=dataset_path,
            tokenizer_path=corpus.tokenizer_path,
            text_field="text",
            seq_len=TINY_MOE["max_target_length"],
            batch_size=8,
            seed=seed,
        )
        try:
            next(it)
        except ValueError:
            continue
        with pytest.raises(ValueError, match="not valid JSON"):
            next(it)
        return seed
    raise AssertionError("no seed puts the bad record in the second batch")


def test_a_folder_that_never_trained_a_step_takes_the_corrected_command(corpus, tmp_path, capsys):
    """A record that fails at step 1 (after the folder was written, before any step was
    recorded), then the command with the data fixed: a data key changed, yet the folder is
    started again, saying so; once it trained, the folder is protected as before."""
    bad = tmp_path / "bad" / "docs.jsonl"  # one document longer than a batch, then a bad record
    bad.parent.mkdir()
    long_doc = " ".join(["w1"] * 300)  # 302 tokens: more than a batch (8 x 32), less than two
    bad.write_text(json.dumps({"text": long_doc}) + "\n{not json\n")
    seed = _second_batch_fails(corpus, str(bad))
    quiet = dict(echo=lambda *_: None)
    failing = config(tmp_path, run_name="r", **files_keys(corpus, dataset_path=str(bad)),
                     data_shuffle_seed=seed)  # fmt: skip
    with pytest.raises(ConfigError, match="step 1: .*record 2 is not valid JSON"):
        train(failing, **quiet)
    folder = tmp_path / "r"
    metrics = folder / "metrics.jsonl"
    assert (folder / "config.yml").is_file() and (not metrics.exists() or not metrics.read_text())
    capsys.readouterr()
    fixed = config(tmp_path, run_name="r", **files_keys(corpus), data_shuffle_seed=seed)
    done = train(fixed, stop_after_step=1, **quiet)
    assert done["resumed_from"] is None and int(done["state"].step) == 1
    note = f"run folder {folder} never trained a step; starting it again with the new config"
    assert note in capsys.readouterr().err
    assert str(corpus.root / "jsonl") in (folder / "config.yml").read_text()
    # Negative control: the folder trained a step now; the other data is refused as before.
    with pytest.raises(ConfigError, match="dataset_path"):
        train(failing, **quiet)
    assert note not in capsys.readouterr().err
