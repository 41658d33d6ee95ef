"""From published weights to a trained HF checkpoint: from-hf -> train (load_parameters_path) ->
to-hf of the run folder -> transformers, on a tiny random Mixtral."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

pytest.importorskip("torch", reason="parity tests need torch (pip install expertax[parity])")
pytest.importorskip("transformers", reason="parity tests need transformers (extra 'parity')")

from hf_models import build, hf_logits, prompt, save  # noqa: E402
from tests.tolerances import tol  # noqa: E402

import expertax  # noqa: E402
from expertax import cli  # noqa: E402
from expertax.convert import from_hf  # noqa: E402
from expertax.data.synthetic import SyntheticData  # noqa: E402
from expertax.train import model_dir as store  # noqa: E402
from expertax.train.loop import train  # noqa: E402

pytestmark = pytest.mark.parity

# Max abs logit difference, expertax vs transformers (float32), as in test_hf.py.
TOLERANCE = {"float32": 1e-4}
MISS = 1e-2


@pytest.fixture(scope="module", autouse=True)
def _cache(persistent_compile_cache):
    yield


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _first_batch_loss(params, c, global_batch: int) -> float:
    """The train step's cross-entropy on batch 0 of the synthetic data, through expertax.logits."""
    data = SyntheticData(
        vocab_size=c.vocab_size,
        seq_len=c.max_target_length,
        global_batch=global_batch,
        seed=c.data_shuffle_seed,
    )
    batch = data.batch_at(0)
    logp = jax.nn.log_softmax(expertax.logits(params, batch["inputs"], c), axis=-1)
    return float(-np.mean(np.take_along_axis(np.asarray(logp), batch["targets"][..., None], -1)))


def test_train_from_hf_weights_and_export_to_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = save(build("mixtral", seed=11), tmp_path / "hf")
    from_hf(hf_dir, tmp_path / "ours")
    _, converted, _ = store.load(tmp_path / "ours")
    c = expertax.load_config(
        tmp_path / "ours" / "config.yml",
        overrides=dict(
            load_parameters_path=str(tmp_path / "ours"),
            base_output_directory=str(tmp_path / "runs"),
            run_name="ft",
            steps=2,
            max_target_length=32,
            per_device_batch_size=1,
            log_period=100,
        ),
    )
    log: list[str] = []
    summary = train(c, echo=log.append)
    assert any(line.startswith("loaded the parameters of") for line in log)

    # Step 0 ran on the converted weights: its loss is theirs, through expertax.logits ...
    records = [json.loads(x) for x in (tmp_path / "runs/ft/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    want = _first_batch_loss(converted, c, global_batch=8)
    np.testing.assert_allclose(records[0]["loss"], want, **tol())
    # ... and not that of other weights (negative control: 10 % off the embedding).
    scaled = dataclasses.replace(converted, embed=converted.embed * 1.1)
    assert abs(_first_batch_loss(scaled, c, global_batch=8) - want) > 1e-3

    # Re-running resumes from the run's checkpoint: load_parameters_path is ignored, and says so.
    log.clear()
    again = train(c, echo=log.append)
    assert again["resumed_from"] == 2
    assert any("ignored: the checkpoint wins" in line for line in log)
    assert not any(line.startswith("loaded the parameters") for line in log)

    # Export the run folder (its step-2 checkpoint) and load it with transformers.
    assert cli.main(["convert", "to-hf", str(tmp_path / "runs/ft"), str(tmp_path / "export")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager")
    ref = hf_logits(model.eval(), prompt())
    trained = summary["state"].params
    diff = _max_diff(expertax.logits(trained, prompt().numpy(), c), ref)
    print(f"\ntrained mixtral via to-hf: max |logits diff| = {diff:.3g}")
    assert diff <= TOLERANCE["float32"]
    # Negative control: training moved the weights, and the export holds the trained ones.
    assert _max_diff(expertax.logits(converted, prompt().numpy(), c), ref) > MISS
    # The source's HF-only fields (token ids) come through from hf_config.json.
    source = json.loads((hf_dir / "config.json").read_text())
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    for key in ("bos_token_id", "max_position_embeddings"):
        assert exported.get(key) == source[key], key
