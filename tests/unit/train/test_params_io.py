"""Parameters into a run (load_parameters_path) and out of one (to-hf of a run folder), no torch.

The end-to-end path through transformers is tests/parity/test_train_from_hf.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertax.config import ConfigError
from expertax.convert import params_from_hf, to_hf
from expertax.models import decoder
from expertax.nn.param import is_spec
from expertax.preflight import load_config
from expertax.train import checkpoint, params_io
from expertax.train import model_dir as store
from expertax.train.loop import prepare
from expertax.train.trainer import build_trainer

pytestmark = pytest.mark.distributed

TINY = dict(
    model_name="mixtral-tiny",
    base_emb_dim=64,
    base_moe_mlp_dim=64,
    vocab_size=128,
    base_num_decoder_layers=1,
    num_experts=4,
    max_target_length=32,
    per_device_batch_size=1,
    steps=4,
)


def prepare_run_dir(c):
    """The checks and the opened run folder of `c`, as `train` does them before compiling."""
    p = prepare(c)
    return p.c, p.run


def tiny(tmp_path, **overrides):
    return load_config(overrides={**TINY, "base_output_directory": str(tmp_path), **overrides})


def random_params(c, seed: int = 0):
    """Numpy parameters of `c`'s shapes (no compiled init)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: rng.standard_normal(s.shape).astype(np.float32), decoder.spec(c), is_leaf=is_spec
    )


@pytest.fixture
def model_dir(tmp_path):
    """A float32 expertax model directory of the TINY shapes, as from-hf writes one."""
    c = tiny(tmp_path)
    params = random_params(c)
    store.save(tmp_path / "model", c, params, source="test")
    return tmp_path / "model", params


def test_not_a_model_directory_is_refused_before_the_run_folder_is_written(tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        c = tiny(tmp_path / "runs", run_name="r", load_parameters_path=str(path))
        with pytest.raises(ConfigError, match=r"load_parameters_path=.*not an expertax model dir"):
            prepare_run_dir(c)
        assert not (tmp_path / "runs" / "r" / "config.yml").exists()


def test_differing_model_keys_are_refused_and_listed(model_dir, tmp_path):
    path, _ = model_dir
    c = tiny(
        tmp_path / "runs",
        run_name="r",
        load_parameters_path=str(path),
        base_emb_dim=32,
        num_experts=8,
        rope_max_timescale=10_000,
        # training keys may differ from the saved ones
        learning_rate=1e-4,
        weight_dtype="bfloat16",
        load_balance_loss_weight=0.01,
    )
    with pytest.raises(ConfigError, match="differs from this run's config") as err:
        prepare_run_dir(c)
    named = str(err.value).split("(")[1].split(")")[0]
    assert set(named.split("; ")) == {
        "base_emb_dim: 64 -> 32",
        "rope_max_timescale: 1000000.0 -> 10000.0",
        "num_experts: 4 -> 8",
    }
    assert not (tmp_path / "runs" / "r" / "config.yml").exists()
    # The same shapes pass (negative control of the refusal), training keys changed or not.
    same = tiny(tmp_path / "runs", run_name="r", load_parameters_path=str(path), learning_rate=1e-4)
    _, run = prepare_run_dir(same)
    run.checkpointer.close()
    assert run.resume_step is None


def test_load_params_into_the_trainer_shardings_and_weight_dtype(model_dir, tmp_path):
    path, stored = model_dir
    c = tiny(tmp_path, load_parameters_path=str(path), weight_dtype="bfloat16")
    trainer = build_trainer(c)
    abstract = trainer.abstract_state().params
    params = params_io.load_params(c, trainer.state_shardings.params, abstract)
    flat = zip(jax.tree.leaves(params), jax.tree.leaves(abstract), jax.tree.leaves(stored))
    for got, want, x in flat:
        assert got.dtype == jnp.bfloat16 and got.sharding == want.sharding
        assert np.array_equal(np.asarray(got), x.astype(jnp.bfloat16))
    state = trainer.init_state(params)
    assert int(state.step) == 0 and state.params is params
    # The optimizer state is fresh: every AdamW moment is zero.
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert moments and all(not np.any(np.asarray(x)) for x in moments)


def test_a_resumed_run_ignores_load_parameters_path(tmp_path):
    _, run = prepare_run_dir(tiny(tmp_path, run_name="r"))
    run.checkpointer.close()
    with checkpoint.Checkpointer(run.path / "checkpoints", period_steps=1, max_to_keep=2) as ck:
        ck.maybe_save(3, {"x": jnp.zeros(2)}, {"step": 3})
    # A path that is no model directory: checked only when the run starts afresh.
    c = tiny(tmp_path, run_name="r", load_parameters_path=str(tmp_path / "missing"))
    _, run = prepare_run_dir(c)
    run.checkpointer.close()
    assert run.resume_step == 3


def test_to_hf_exports_the_latest_checkpoint_of_a_run(tmp_path):
    c, run = prepare_run_dir(tiny(tmp_path, run_name="r"))
    trainer = build_trainer(c)
    states = [random_params(c, seed) for seed in (1, 2)]
    with pytest.raises(ValueError, match="no complete checkpoint"):
        to_hf(run.path, tmp_path / "none")
    for step, params in zip((2, 4), states, strict=True):
        state = trainer.init_state(
            jax.device_put(params, trainer.state_shardings.params)
        )  # the optimizer state is saved too, and not read back
        run.checkpointer.maybe_save(step, state, {"step": step}, force=True)
    run.checkpointer.close()
    assert params_io.is_run_dir(run.path) and not params_io.is_run_dir(tmp_path)
    files = to_hf(run.path, tmp_path / "hf")
    assert files[0] == "config.json"
    back_c, back, _ = params_from_hf(tmp_path / "hf")
    assert back_c.base_emb_dim == 64 and back_c.num_experts == 4
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(states[1]), strict=True):
        assert a.tobytes() == b.tobytes()  # the latest step, bit for bit
    assert not np.array_equal(jax.tree.leaves(states[0])[0], jax.tree.leaves(states[1])[0])
