"""`expertax generate`: sources, prompts, overrides, output, and every refusal before compiling.

One tiny Mixtral-shaped model (random float32 weights) as an HF folder with a tokenizer, converted
with `expertax convert from-hf` into a model directory, and saved again as a training run folder
with two checkpoints (the older one holds other weights). What the command prints and writes
(--json) must be what `expertax.decoding.generate` returns for the same prompts and settings.
Greedy runs share one prompt length and budget, so each source compiles its loop once.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from expertax.cli import main
from expertax.config import ConfigError, config_to_yaml
from expertax.convert import write_hf
from expertax.decoding import generate
from expertax.models import decoder
from expertax.nn.param import is_spec
from expertax.preflight import load_config
from expertax.tools import generate as gen_cli
from expertax.tools import generate_source as source
from expertax.train import checkpoint, model_dir

pytestmark = pytest.mark.distributed

TINY = dict(
    model_name="mixtral-tiny",
    base_emb_dim=32,
    head_dim=16,
    base_moe_mlp_dim=32,
    vocab_size=64,  # past the tokenizer's 23 ids, as hub models pad theirs
    base_num_decoder_layers=1,
    num_experts=4,
    max_target_length=32,
)
BOS, EOS = 1, 2  # "<s>", "</s>" in the tokenizer below (after "<unk>")
NEW = "6"  # --max-new-tokens of every greedy run (one compiled loop per source)


def random_params(c, seed: int):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: rng.standard_normal(s.shape).astype(np.float32), decoder.spec(c), is_leaf=is_spec
    )


def train_tokenizer(path: Path) -> tokenizers.Tokenizer:
    """A WordLevel tokenizer over w0 .. w19 with <unk>, <s>, </s> (ids 0, 1, 2)."""
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([" ".join(f"w{i}" for i in range(20))], trainer)
    tok.save(str(path))
    return tok


@dataclasses.dataclass
class World:
    root: Path
    hf: Path  # an HF folder with tokenizer.json and tokenizer_config.json
    model: Path  # its `convert from-hf` model directory
    run: Path  # a run folder of the same model: step 2 holds `old`, step 4 `params`
    bare: Path  # a model directory without a tokenizer
    synthetic: Path  # a run folder on synthetic data (no tokenizer_path): step 4 holds `params`
    tok: tokenizers.Tokenizer
    params: object
    old: object


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("generate")
    c = load_config(overrides=TINY)
    params, old = random_params(c, 1), random_params(c, 0)
    hf = root / "hf"
    write_hf(params, c, hf)
    tok = train_tokenizer(hf / "tokenizer.json")
    (hf / "tokenizer_config.json").write_text('{"model_max_length": 32}\n')
    hf_config = json.loads((hf / "config.json").read_text())
    hf_config.update(bos_token_id=BOS, eos_token_id=EOS)
    (hf / "config.json").write_text(json.dumps(hf_config))
    assert main(["convert", "from-hf", str(hf), str(root / "model")]) == 0
    converted = model_dir.read_config(root / "model")

    run = root / "run"
    run.mkdir()
    run_config = converted.model_copy(update={"tokenizer_path": str(hf / "tokenizer.json")})
    (run / "config.yml").write_text(config_to_yaml(run_config))
    with checkpoint.Checkpointer(run / "checkpoints", period_steps=1, max_to_keep=3) as ck:
        for step, p in ((2, old), (4, params)):
            ck.maybe_save(step, {"params": jax.tree.map(jax.numpy.asarray, p)}, {}, force=True)
    model_dir.save(root / "bare", converted, params, source="test")
    synthetic = root / "synthetic"
    synthetic.mkdir()
    assert converted.dataset_type == "synthetic" and not converted.tokenizer_path
    (synthetic / "config.yml").write_text(config_to_yaml(converted))
    with checkpoint.Checkpointer(synthetic / "checkpoints", period_steps=1, max_to_keep=1) as ck:
        ck.maybe_save(4, {"params": jax.tree.map(jax.numpy.asarray, params)}, {}, force=True)
    return World(root, hf, root / "model", run, root / "bare", synthetic, tok, params, old)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def reference(c, params, prompts, **kw):
    kw.setdefault("max_new_tokens", int(NEW))
    return generate(jax.tree.map(jax.numpy.asarray, params), c, prompts, **kw)


def encoded(tok, text: str) -> list[int]:
    return [BOS, *tok.encode(text, add_special_tokens=False).ids]


def run_json(capsys, tmp_path, *argv) -> tuple[str, dict]:
    """A greedy run of `NEW` tokens that succeeds: (what it printed, its --json document)."""
    out_json = tmp_path / "out.json"
    rc, out, _ = run_cli(capsys, *argv, "--max-new-tokens", NEW, "--json", out_json)
    assert rc == 0
    return out, json.loads(out_json.read_text())


def test_text_and_id_prompts_from_a_model_directory(world, capsys, tmp_path):
    out, doc = run_json(
        capsys, tmp_path, world.model, "--prompt", "w1 w2 w3", "--prompt-ids", "5,6,7"
    )
    prompts = [encoded(world.tok, "w1 w2 w3"), [5, 6, 7]]
    assert [r["prompt_ids"] for r in doc["results"]] == prompts
    assert [r["prompt"] for r in doc["results"]] == ["w1 w2 w3", None]
    # the HF config's ids and position range (max_position_embeddings = 32)
    ref = reference(
        model_dir.read_config(world.model), world.params, prompts, eos_id=EOS, max_length=32
    )
    assert [r["ids"] for r in doc["results"]] == ref.tokens
    assert [r["logprobs"] for r in doc["results"]] == ref.logprobs
    assert [r["finished"] for r in doc["results"]] == ref.finished
    assert all(ref.tokens) and ref.tokens[0] != ref.tokens[1]
    assert doc["results"][0]["text"] == world.tok.decode(ref.tokens[0], skip_special_tokens=True)
    assert doc["settings"]["eos_id"] == EOS and doc["settings"]["temperature"] == 0.0
    assert doc["tokenizer"] == str(world.model / "tokenizer.json")
    assert doc["tokens_generated"] == sum(len(t) for t in ref.tokens)
    lines = out.splitlines()
    assert lines[0].endswith("mesh fsdp=8 over 8 cpu devices")
    assert lines[1] == "[0] prompt (4 tokens): w1 w2 w3"
    assert lines[3] == "[1] prompt (3 tokens): ids 5 6 7"
    unknown = sum(t >= world.tok.get_vocab_size() for t in ref.tokens[0])
    assert unknown and f"[+{unknown} ids outside the tokenizer's vocabulary" in lines[2]
    assert lines[-1].startswith(f"expertax: {doc['tokens_generated']} tokens for 2 prompt(s) in")


def test_a_run_folder_decodes_its_latest_checkpoint_with_its_tokenizer(world, capsys, tmp_path):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text('{"ids": [5, 6, 7]}\n\n{"prompt": "w4 w5"}\n')
    out_json = tmp_path / "out.json"
    flags = f"--prompts-file {prompts_file} --max-new-tokens {NEW} --json {out_json}".split()
    argv = (world.run, "--prompt", "w1 w2 w3", *flags)
    rc, out, _ = run_cli(capsys, *argv)
    assert rc == 0 and "step 4" in out.splitlines()[0]
    doc = json.loads(out_json.read_text())
    prompts = [encoded(world.tok, "w1 w2 w3"), [5, 6, 7], encoded(world.tok, "w4 w5")]
    assert [r["prompt_ids"] for r in doc["results"]] == prompts  # flags first, then the file
    c = source.open_source(world.run, []).config
    ref = reference(c, world.params, prompts, eos_id=EOS)
    assert [r["ids"] for r in doc["results"]] == ref.tokens
    assert [r["logprobs"] for r in doc["results"]] == ref.logprobs
    # negative control: the older checkpoint continues differently
    older = reference(c, world.old, prompts, eos_id=EOS)
    assert (older.tokens, older.logprobs) != (ref.tokens, ref.logprobs)
    # greedy: the same command gives the same document (written over the first)
    assert run_cli(capsys, *argv, "--overwrite")[0] == 0
    assert json.loads(out_json.read_text())["results"] == doc["results"]


def test_a_synthetic_data_run_reads_and_writes_its_numbers_as_text(world, capsys, tmp_path):
    """No tokenizer_path, synthetic data: token id i is the word "i" both ways, no BOS."""
    argv = (world.synthetic, "--prompt", " 5  6\t7 ", "--prompt-ids", "5,6,7")
    out, doc = run_json(capsys, tmp_path, *argv)
    assert [r["prompt_ids"] for r in doc["results"]] == [[5, 6, 7], [5, 6, 7]]
    c = source.open_source(world.synthetic, []).config
    ref = reference(c, world.params, [[5, 6, 7]]).tokens[0]
    assert [r["ids"] for r in doc["results"]] == [ref, ref]
    assert doc["results"][0]["text"] == " ".join(map(str, ref))
    assert doc["tokenizer"] == source.SYNTHETIC_TOKENIZER
    lines = out.splitlines()
    assert lines[1] == "[0] prompt (3 tokens):  5  6\t7 "
    assert lines[2].endswith(" ".join(map(str, ref))), lines[2]
    # anything but whole numbers below vocab_size is refused before the weights are read
    for bad in ("5 six 7", "5 64"):
        with pytest.raises(ConfigError, match="whole numbers from 0 to 63 separated by spaces"):
            gen_cli.make_prompts([("text", bad)], source.open_source(world.synthetic, []))


def test_sampling_settings_reach_generate(world, capsys, tmp_path):
    out_json = tmp_path / "out.json"
    flags = "--temperature 4 --top-k 9 --top-p 0.95 --seed 3 --prompt-ids 5,6,7".split()
    rc, _, _ = run_cli(capsys, world.model, *flags, "--max-new-tokens", NEW, "--json", out_json)
    assert rc == 0
    doc = json.loads(out_json.read_text())
    c = model_dir.read_config(world.model)
    kw = dict(temperature=4.0, top_k=9, top_p=0.95, eos_id=EOS, max_length=32)
    ids = doc["results"][0]["ids"]
    assert ids == reference(c, world.params, [[5, 6, 7]], seed=3, **kw).tokens[0]
    assert ids != reference(c, world.params, [[5, 6, 7]], seed=4, **kw).tokens[0]  # seed used
    settings = dict(temperature=4.0, top_k=9, top_p=0.95, seed=3)
    assert {k: doc["settings"][k] for k in settings} == settings


def test_fp8_weights_reach_generate(world, capsys, tmp_path):
    out_json = tmp_path / "out.json"
    flags = ["--fp8-weights", "--prompt-ids", "5,6,7", "--max-new-tokens", NEW]
    rc, _, _ = run_cli(capsys, world.model, *flags, "--json", out_json)
    assert rc == 0
    doc = json.loads(out_json.read_text())
    c = model_dir.read_config(world.model)
    kw = dict(eos_id=EOS, max_length=32, fp8_weights=True)
    assert doc["results"][0]["ids"] == reference(c, world.params, [[5, 6, 7]], **kw).tokens[0]
    assert doc["settings"]["fp8_weights"] is True


def _no_run_folder(world) -> Path:
    """A run folder killed before its first checkpoint: config.yml and an empty checkpoint dir."""
    path = world.root / "fresh"
    if not path.exists():
        path.mkdir()
        shutil.copy(world.run / "config.yml", path / "config.yml")
        checkpoint.mark_directory(path / "checkpoints")
    return path


def _damaged_marker(world) -> Path:
    """A run folder whose checkpoint folder's marker file was cut short."""
    path = world.root / "damaged"
    if not path.exists():
        shutil.copytree(world.run, path)
        (path / "checkpoints" / checkpoint.MARKER_FILE).write_text('{"format": ')
    return path


# (arguments after SOURCE, source name in World or a path under root, expected message part)
REFUSED = [
    (["--prompt", "w1"], "damaged", "expertax_checkpoints.json is damaged (JSONDecodeError"),
    (["--prompt-ids", "-1,2"], "model", "--prompt-ids='-1,2': '-1' is not a non-negative"),
    (["--prompt-ids", "1", "--top-k", "5"], "model", "--top-k=5 is read when sampling only"),
    (["--prompt-ids", "1", "--top-p", "0.5"], "model", "--top-p=0.5 is read when sampling only"),
    (["--prompt-ids", "1", "--seed", "3"], "model", "--seed=3 is read when sampling only"),
    (["--prompts-file", "extra.jsonl"], "model", "line 1: unknown key 'why'"),
    (["--prompts-file", "latin1.jsonl"], "model", "is not UTF-8 text (byte 0xe9"),
    (["--prompt", "w1"], "nothing", "does not exist: give a training run folder"),
    (["--prompt", "w1"], "hf", "is neither: give a training run folder"),
    (["--prompt", "w1"], "fresh", "without a complete checkpoint"),
    (["--prompt", "w1"], "bare", "text needs a tokenizer"),
    (["--prompt", "5 six"], "synthetic", "cannot encode it"),
    (
        ["--prompt-ids", "1", "--prefill-chunk", "0"],
        "model",
        "--prefill-chunk=0: use an integer",
    ),
    (["--prompt-ids", "1", "base_emb_dim=64"], "model", "base_emb_dim=64: a model key"),
    (["--prompt-ids", "1", "learning_rate=0.1"], "model", "learning_rate=0.1: a training key"),
    (["--prompt-ids", "1", "tokenizer_path=t.json"], "model", "with --tokenizer PATH"),
    (["--prompt-ids", "1", "ici_pipeline_parallelism=2"], "model", "decoding sets ici_pipel"),
    (["--prompt-ids", "1", "no_such_key=1"], "model", "unknown key 'no_such_key'"),
    (["--prompt-ids", "1", "dtype=float64"], "model", "dtype='float64'"),
    (
        ["--prompt-ids", "1", "--temperature", "-1"],
        "model",
        "--temperature=-1.0: use a finite",
    ),
    (["--prompt-ids", "1", "--top-p", "0"], "model", "--top-p=0.0: use a finite number in (0, 1]"),
    (
        ["--prompt-ids", "1", "--top-p", "1.5"],
        "model",
        "--top-p=1.5: use a finite number in",
    ),
    (["--prompt-ids", "1", "--top-k", "-2"], "model", "--top-k=-2: use an integer >= 0"),
    (
        ["--prompt-ids", "1", "--max-new-tokens", "0"],
        "model",
        "--max-new-tokens=0: use an integer",
    ),
    (["--prompt-ids", "1", "--max-new-tokens", "32"], "model", "use --max-new-tokens <= 31"),
    (["--prompt-ids", ",".join(["3"] * 30)], "model", "past the model's position range"),
    (["--prompt-ids", ",".join(["3"] * 130)], "run", "longer than max_target_length=128"),
    (["--prompt-ids", "1,x"], "model", "--prompt-ids='1,x'"),
    (["--prompt-ids", "1,64"], "model", "--prompt-ids='1,64': 64 is not below the vocab size (64)"),
    (["--prompt-ids", "1,,2"], "model", "--prompt-ids='1,,2': entry 2 is empty; use comma-sep"),
    (["--prompt-ids", "1", "--speculative"], "model", "--speculative needs a model with MTP"),
    (["--prompt-ids", "1", "--tokenizer", "missing.json"], "model", "--tokenizer='missing.json'"),
    (["--prompt-ids", "1", "--json", "no/such/dir/out.json"], "model", "does not exist; create"),
    (["--prompt-ids", "1", "--record-routing", "no/dir/r.npz"], "model", "does not exist; create"),
    (["--prompt-ids", "1", "--record-routing", "bad.jsonl"], "model", "exists already: add"),
    (["--prompt-ids", "1", "--prompts-file", "missing.jsonl"], "model", "does not exist"),
    (["--prompts-file", "bad.jsonl"], "model", 'line 2: expected {"prompt"'),
    ([], "model", "prompts: none given"),
]


@pytest.mark.parametrize("args, where, message", REFUSED)
def test_refused_with_one_line_before_reading_the_weights(
    world, capsys, monkeypatch, args, where, message
):
    def never(*a, **k):
        raise AssertionError("the parameters were read")

    monkeypatch.setattr(gen_cli, "load_params", never)
    monkeypatch.chdir(world.root)
    (world.root / "bad.jsonl").write_text('{"ids": [1]}\n{"prompt": "w1", "ids": [1]}\n')
    (world.root / "extra.jsonl").write_text('{"prompt": "w1", "why": "a note"}\n')
    (world.root / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    built = {"fresh": _no_run_folder, "damaged": _damaged_marker}
    src = built[where](world) if where in built else getattr(world, where, world.root / where)
    rc, out, err = run_cli(capsys, src, "--max-new-tokens", "4", *args)
    assert rc == 2 and out == ""
    assert err.startswith("expertax: error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_overrides_that_keep_the_model_are_applied_and_validated(world):
    saved = model_dir.read_config(world.model)
    wanted = dict(attention_impl="dot", ici_expert_parallelism=2, dtype="bfloat16")
    c = source.with_overrides(saved, [f"{k}={v}" for k, v in wanted.items()])
    assert {k: getattr(c, k) for k in wanted} == wanted
    assert saved.dtype == "float32" and source.with_overrides(saved, []) is saved
    with pytest.raises(ConfigError, match="attention_impl='fast'"):
        source.with_overrides(saved, ["attention_impl=fast"])


def test_a_model_directory_takes_its_ids_and_position_range_from_the_hf_config(world, tmp_path):
    s = source.open_source(world.model, [])
    assert (s.bos_id, s.eos_id, s.max_length) == (BOS, EOS, 32)
    copy = tmp_path / "model"
    shutil.copytree(world.model, copy)
    hf_config = json.loads((copy / model_dir.HF_CONFIG).read_text())
    hf_config.update(eos_token_id=[7, EOS], max_position_embeddings=48)
    (copy / model_dir.HF_CONFIG).write_text(json.dumps(hf_config))
    s = source.open_source(copy, [])
    assert (s.bos_id, s.eos_id, s.max_length) == (BOS, 7, 48)  # the first of a list
    # no HF config: the tokenizer's own BOS and EOS, the config's position range
    (copy / model_dir.HF_CONFIG).unlink()
    s = source.open_source(copy, [])
    assert (s.bos_id, s.eos_id, s.max_length) == (BOS, EOS, None)
    s = source.open_source(world.bare, [])
    assert (s.tokenizer, s.bos_id, s.eos_id) == (None, None, None)
    # --tokenizer wins over the directory's
    other = tmp_path / "other.json"
    tok = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "x": 1}, unk_token="<unk>"))
    tok.save(str(other))
    s = source.open_source(copy, [], str(other))
    assert s.tokenizer_path == str(other) and s.tokenizer.get_vocab_size() == 2


def test_the_summary_reports_mtp_acceptance(world):
    doc = {
        "results": [],
        "tokens_generated": 12,
        "seconds": 2.0,
        "acceptance": 0.75,
        "drafts_proposed": 8,
        "drafts_accepted": 6,
    }
    out = io.StringIO()
    gen_cli.print_results(source.open_source(world.bare, []), doc, out)
    assert "12 tokens for 0 prompt(s) in 2.00 s" in out.getvalue()
    assert "(6.0 tokens/s); MTP drafts accepted 6/8 (75.0 %)" in out.getvalue()


def test_a_run_checkpoint_that_cannot_be_read_gives_way_to_the_older_one(world, tmp_path, capsys):
    """Step 4's array chunks cut short (its files all there): generate reads step 2, names
    step 4 on stderr and reports the step it read; no step that reads is one error naming the
    folder. Negative control: the intact copy reads step 4, silently."""
    from tests.unit.train.test_checkpoint import cut_array_chunks

    copy = tmp_path / "run"
    shutil.copytree(world.run, copy)
    intact, intact_source = source.load_params(source.open_source(copy, []), None)
    assert intact_source.step == 4 and capsys.readouterr().err == ""
    assert cut_array_chunks(copy / "checkpoints" / "4") > 0
    opened = source.open_source(copy, [])
    assert opened.step == 4  # the files are all there: found only by reading
    params, read_from = source.load_params(opened, None)
    assert read_from.step == 2 and "step 2" in read_from.describe()
    for got, old in zip(jax.tree.leaves(params), jax.tree.leaves(world.old), strict=True):
        np.testing.assert_array_equal(np.asarray(got), old)
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert (
        f"the checkpoint of step 4 in {copy / 'checkpoints'} is damaged (it cannot be read: " in err
    )
    assert err.rstrip().endswith("reading step 2")
    cut_array_chunks(copy / "checkpoints" / "2")
    with pytest.raises(ConfigError) as e:
        source.load_params(opened, None)
    assert str(e.value).startswith(f"run folder {copy}: no checkpoint in {copy / 'checkpoints'}")
    assert "step 2: " in str(e.value) and "step 4: " in str(e.value)
