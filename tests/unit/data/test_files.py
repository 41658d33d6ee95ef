"""dataset_type=files (expertax.data.files): packing, inputs, shuffle, sharding, resume, errors."""

from __future__ import annotations

import collections
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_corpus import BOS, EOS, train_tokenizer

from expertax.data import files, packing, tokenizer

SEQ_LEN = 16
BATCH = 3


def make(corpus, path=None, **kwargs):
    args = dict(
        dataset_path=str(path or corpus.root / "jsonl"),
        tokenizer_path=corpus.tokenizer_path,
        text_field="text",
        seq_len=SEQ_LEN,
        batch_size=BATCH,
        seed=0,
        num_epochs=1,
    )
    args.update(kwargs)
    return files.make_file_iterator(**args)


def rows(batches):
    for b in batches:
        for i in range(b["inputs"].shape[0]):
            yield {k: v[i] for k, v in b.items()}


def chunks(row):
    """(tokens, continues) per segment: its inputs, plus its last target when that is weighted."""
    out = []
    for s in range(1, int(row["segment_ids"].max(initial=0)) + 1):
        (idx,) = np.nonzero(row["segment_ids"] == s)
        tokens = row["inputs"][idx].tolist()
        if row["weights"][idx[-1]] == 1:
            tokens.append(int(row["targets"][idx[-1]]))
        out.append(tokens)
    return out


def documents(batches, eos_id, complete=True):
    """Re-assembles documents: a chunk not ending in EOS continues as the next row's first chunk,
    whose first token repeats the chunk's last one (a row's last token is a target only)."""
    docs, pending = [], None
    for row in rows(batches):
        for tokens in chunks(row):
            if pending is not None:
                assert tokens[0] == pending[-1], "continuation must repeat the last token"
                tokens = pending + tokens[1:]
                pending = None
            if tokens[-1] == eos_id:
                docs.append(tokens)
            else:
                pending = tokens
    assert pending is None or not complete
    return docs


def doc_ids(batches, corpus, complete=True):
    """The documents' first words (unique per document), in the order they are packed."""
    eos = corpus.tokenizer.token_to_id(EOS)
    return [corpus.tokenizer.id_to_token(d[1]) for d in documents(batches, eos, complete)]


def first_words(docs):
    return [d.split()[0] for d in docs]


def test_packed_batches_decode_to_the_documents(corpus):
    batches = list(make(corpus))
    eos = corpus.tokenizer.token_to_id(EOS)
    got = documents(batches, eos)
    assert sorted(got) == sorted(corpus.encode(d) for d in corpus.jsonl_docs)
    decoded = sorted(corpus.tokenizer.decode(d, skip_special_tokens=True) for d in got)
    assert decoded == sorted(corpus.jsonl_docs)
    # Every next-token pair inside a document is trained exactly once.
    pairs = sum(len(corpus.encode(d)) - 1 for d in corpus.jsonl_docs)
    assert sum(float(b["weights"].sum()) for b in batches) == pairs
    # Some documents were split, some rows hold several documents (the test exercises both).
    assert any(len(corpus.encode(d)) > SEQ_LEN + 1 for d in corpus.jsonl_docs)
    assert any(b["segment_ids"].max() >= 3 for b in batches)


def test_row_structure(corpus):
    batches = list(make(corpus))
    for b in batches:
        assert set(b) == set(packing.ROW_KEYS)
        for k, v in b.items():
            assert v.shape == (BATCH, SEQ_LEN), k
            assert v.dtype == (np.float32 if k == "weights" else np.int32), k
    bos = corpus.tokenizer.token_to_id(BOS)
    for row in rows(batches):
        seg, pos, w = row["segment_ids"], row["positions"], row["weights"]
        real = seg > 0
        if not real.any():  # an all-padding row (the end of the data)
            assert w.sum() == 0
            continue
        # Segments are 1, 2, … in order, padding (0) only at the end.
        assert seg[0] == 1 and np.all(np.isin(np.diff(seg[real]), [0, 1]))
        np.testing.assert_array_equal(real, np.arange(SEQ_LEN) < real.sum())
        # Positions restart at 0 with each segment and count up.
        starts = np.concatenate([[True], seg[1:] != seg[:-1]])
        expected = np.zeros(SEQ_LEN, np.int32)
        for i in range(1, SEQ_LEN):
            expected[i] = 0 if starts[i] else expected[i - 1] + 1
        np.testing.assert_array_equal(pos[real], expected[real])
        np.testing.assert_array_equal(pos[~real], 0)
        # Inside the row: weight 1 iff the next input is the same document; target = next input.
        same = (seg[:-1] == seg[1:]) & real[:-1]
        np.testing.assert_array_equal(w[:-1], same.astype(np.float32))
        np.testing.assert_array_equal(row["targets"][:-1][same], row["inputs"][1:][same])
        np.testing.assert_array_equal(row["targets"][w == 0], 0)
        np.testing.assert_array_equal(row["inputs"][~real], 0)
        # A segment starting at a position > 0 in the row starts a new document (BOS).
        for i in np.nonzero(starts & real)[0]:
            if i > 0:
                assert row["inputs"][i] == bos


@pytest.mark.parametrize(
    "path, docs",
    [
        ("jsonl/a.jsonl", lambda c: c.jsonl_docs[:18]),
        ("jsonl", lambda c: c.jsonl_docs),  # directory, recursive, README ignored
        ("jsonl/**/*.jsonl", lambda c: c.jsonl_docs),  # recursive glob
        ("jsonl/*.jsonl", lambda c: c.jsonl_docs[:18]),
        ("parquet/docs.parquet", lambda c: c.parquet_docs),
        ("text", lambda c: c.text_docs),
        ("text/doc0[0-2].txt", lambda c: c.text_docs[:3]),
        ("", lambda c: c.all_docs),  # the whole tree: three formats mixed
    ],
)
def test_inputs(corpus, path, docs):
    got = doc_ids(list(make(corpus, corpus.root / path)), corpus)
    assert sorted(got) == sorted(first_words(docs(corpus)))


def test_parquet_reads_every_row_group(corpus):
    meta = pq.ParquetFile(corpus.root / "parquet" / "docs.parquet").metadata
    assert meta.num_row_groups == 5
    it = make(corpus, corpus.root / "parquet", batch_size=1)
    eos = corpus.tokenizer.token_to_id(EOS)
    assert sorted(documents(it, eos)) == sorted(corpus.encode(d) for d in corpus.parquet_docs)


def test_shuffle_is_deterministic_per_seed(corpus):
    order = lambda seed: doc_ids(list(make(corpus, seed=seed)), corpus)
    assert order(0) == order(0)
    assert order(0) != order(1)
    assert order(0) != first_words(corpus.jsonl_docs)  # not the file order
    # Grain permutes epoch e with seed + e; the hashed seed keeps seed 1 from replaying
    # seed 0's second epoch.
    second_epoch_of_seed_0 = doc_ids(list(make(corpus, seed=0, num_epochs=2)), corpus)[30:]
    assert order(1) != second_epoch_of_seed_0


def test_each_epoch_is_a_new_permutation(corpus):
    got = doc_ids(list(make(corpus, num_epochs=2)), corpus)
    first, second = got[:30], got[30:]
    assert sorted(first) == sorted(second) == sorted(first_words(corpus.jsonl_docs))
    assert first != second


def test_forever_keeps_going(corpus):
    it = make(corpus, num_epochs=None)
    batches = [next(it) for _ in range(60)]  # more than 2 epochs of this corpus
    counts = collections.Counter(doc_ids(batches, corpus, complete=False)[:90])
    assert set(counts.values()) == {3}


def test_two_processes_get_disjoint_covering_shards(corpus):
    shards = [
        doc_ids(list(make(corpus, corpus.root, process_index=i, process_count=2)), corpus)
        for i in range(2)
    ]
    assert set(shards[0]).isdisjoint(shards[1])
    assert sorted(shards[0] + shards[1]) == sorted(first_words(corpus.all_docs))
    assert abs(len(shards[0]) - len(shards[1])) <= 1


def test_last_batch_is_padded(corpus):
    batches = list(make(corpus, batch_size=4))
    last = batches[-1]
    assert last["inputs"].shape == (4, SEQ_LEN)
    empty = last["segment_ids"].max(axis=1) == 0
    assert empty.any(), "this corpus does not fill the last batch; pick another batch size"
    assert last["weights"][empty].sum() == 0
    assert np.all(last["segment_ids"][~empty].max(axis=1) > 0)


@pytest.mark.parametrize("skip", [0, 1, 2, 5, 9])
@pytest.mark.parametrize("worker_count", [0, 2])
def test_resume_gives_the_same_next_batches(corpus, skip, worker_count):
    kwargs = dict(path=corpus.root, num_epochs=None, worker_count=worker_count, seed=3)
    it = make(corpus, **kwargs)
    for _ in range(skip):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(6)]

    resumed = make(corpus, **kwargs)
    resumed.set_state(state)
    for want, got in zip(expected, [next(resumed) for _ in range(6)], strict=True):
        for k in packing.ROW_KEYS:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)

    fresh = make(corpus, **kwargs)  # negative control: without set_state the batches differ
    if skip:
        assert not np.array_equal(next(fresh)["inputs"], expected[0]["inputs"])


def test_resume_states_mid_document(corpus):
    """A state is taken inside a split document at least once, and resuming there is exact."""
    it = make(corpus, num_epochs=1, batch_size=1)
    offsets = []
    while True:
        state = it.get_state()
        offsets.append(state["pipeline"]["doc_offset"])
        try:
            want = next(it)
        except StopIteration:
            break
        other = make(corpus, num_epochs=1, batch_size=1)
        other.set_state(json.loads(json.dumps(state)))
        got = next(other)
        for k in packing.ROW_KEYS:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert max(offsets) > 0
    with pytest.raises(StopIteration):  # the end of a finite run is restored too
        other = make(corpus, num_epochs=1, batch_size=1)
        other.set_state(state)
        next(other)


def test_worker_count_does_not_change_the_batches(corpus):
    a = list(make(corpus, corpus.root, worker_count=0))
    b = list(make(corpus, corpus.root, worker_count=2))
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for k in packing.ROW_KEYS:
            np.testing.assert_array_equal(x[k], y[k])


def test_state_from_another_configuration_is_refused(corpus):
    state = make(corpus, seed=0).get_state()
    with pytest.raises(ValueError, match="seed"):
        make(corpus, seed=1).set_state(state)


def test_no_matching_files(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"dataset_path=.*nothing\*\.jsonl.*matches no data files"):
        make(corpus, corpus.root / "nothing*.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"dataset_path=.*\.jsonl, \.parquet, \.txt"):
        make(corpus, tmp_path / "empty")
    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"dataset_path=.*data\.csv.*unsupported extension"):
        make(corpus, tmp_path / "data.csv")


def test_missing_text_field(corpus, tmp_path):
    with pytest.raises(
        ValueError, match=r"data_text_field='body'.*available fields: \['meta', 'text'\]"
    ):
        make(corpus, text_field="body")
    with pytest.raises(ValueError, match=r"data_text_field='body'.*Parquet.*\['id', 'text'\]"):
        make(corpus, corpus.root / "parquet", text_field="body")
    # A later record without the field is reported when it is read.
    path = tmp_path / "late.jsonl"
    path.write_text(json.dumps({"text": "w1 w2"}) + "\n" + json.dumps({"txt": "w3"}) + "\n")
    with pytest.raises(ValueError, match=r"data_text_field='text'.*late\.jsonl \(record 2\)"):
        list(make(corpus, path))


def test_text_file_not_utf8(corpus, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 w1".encode("latin-1"))
    with pytest.raises(ValueError, match=r"dataset_path: .*latin1\.txt is not UTF-8"):
        list(make(corpus, tmp_path))


def test_bad_tokenizer(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer_path=.*missing\.json.*no such file"):
        make(corpus, tokenizer_path=str(tmp_path / "missing.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_path=.*not a valid HuggingFace"):
        make(corpus, tokenizer_path=str(bad))
    with pytest.raises(ValueError, match=r"tokenizer_path=.*not a valid HuggingFace"):
        tokenizer.load_tokenizer(str(tmp_path))  # a directory: its tokenizer.json is used


def test_bad_arguments(corpus):
    with pytest.raises(ValueError, match="process_index=2"):
        make(corpus, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="num_epochs=0"):
        make(corpus, num_epochs=0)
    with pytest.raises(ValueError, match="too few for process_index=4"):
        make(corpus, corpus.root / "text/doc00.txt", process_index=4, process_count=5)


def test_tokenizer_without_special_tokens(corpus, tmp_path):
    path = train_tokenizer(tmp_path / "plain.json", corpus.jsonl_docs, [])
    encoder = tokenizer.DocumentEncoder.from_tokenizer(tokenizer.load_tokenizer(path))
    assert encoder.bos_id is None and encoder.eos_id is None
    it = make(corpus, tokenizer_path=path, batch_size=1)
    pairs = sum(len(d.split()) - 1 for d in corpus.jsonl_docs)
    assert sum(float(b["weights"].sum()) for b in it) == pairs


def test_encoder_frames_documents(corpus):
    encoder = tokenizer.DocumentEncoder.from_tokenizer(
        tokenizer.load_tokenizer(str(corpus.root / "tok"))
    )
    ids = encoder("w1 w2")
    assert ids.dtype == np.int32
    assert ids.tolist() == corpus.encode("w1 w2")
    assert encoder("").shape == (0,)


def test_short_documents_are_skipped(corpus, tmp_path):
    """Empty and null texts carry nothing to predict; they are skipped, not padded rows."""
    path = tmp_path / "short.parquet"
    pq.write_table(pa.table({"text": ["", None, "w1 w2", ""]}), path)
    batches = list(make(corpus, path, batch_size=1))
    assert len(batches) == 1
    assert float(batches[0]["weights"].sum()) == 3  # <s> w1 w2 </s>
