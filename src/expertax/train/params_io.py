"""Parameters into a run from a model directory, and out of a run for export.

- `load_parameters_path` (MaxText's name): a new run starts from the parameters of an expertax
  model directory (`expertax convert from-hf` output, see `train/model_dir.py`) instead of a random
  init; the optimizer state is fresh and the step 0. `check_model_dir` refuses, before anything
  is compiled, a directory that is not a model directory or whose config.yml differs from the
  run's in a key of kind `model` (declared in the schema). A run that resumes from its own
  checkpoint ignores the key.
- `load_run_params`: the parameters (only) of a run directory's latest complete checkpoint, for
  `expertax convert to-hf RUN_DIR OUT_DIR`.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from expertax.config.schema import MODEL, Config, changed_keys
from expertax.errors import ConfigError
from expertax.models import decoder
from expertax.nn.param import is_spec
from expertax.preflight import build_config
from expertax.train import checkpoint, config_file, model_dir

# The run folder <base_output_directory>/<run_name> holds config.yml and this checkpoint folder.
CHECKPOINT_SUBDIR = "checkpoints"


def check_model_dir(c: Config) -> Config:
    """The Config saved in `c.load_parameters_path`; ConfigError unless that is an expertax
    model directory whose model keys equal the run's."""
    path = c.load_parameters_path
    try:
        saved = model_dir.read_config(path)
    except ValueError as e:  # ConfigError (a bad config.yml) is a ValueError too
        raise ConfigError(f"load_parameters_path={path!r}: {e}") from None
    diffs = changed_keys(saved.model_dump(), c, [MODEL])
    if diffs:
        raise ConfigError(
            f"load_parameters_path={path!r}: its config.yml differs from this run's config in "
            f"keys that change the model ({'; '.join(diffs)}); start from the saved values "
            f"(expertax train {Path(path) / 'config.yml'} ...)"
        )
    return saved


def load_params(c: Config, shardings, abstract) -> decoder.Decoder:
    """The parameters of `c.load_parameters_path`, read into `shardings` (a Decoder tree) and
    cast to the dtypes of `abstract` (the run's weight_dtype) where the stored ones differ."""
    check_model_dir(c)
    path = c.load_parameters_path
    try:
        _, params, _ = model_dir.load(path, shardings)
    except (OSError, ValueError, KeyError, TypeError) as e:  # Orbax, tensorstore: files gone
        raise ConfigError(
            f"load_parameters_path={path!r}: its parameters ({Path(path) / model_dir.PARAMS_DIR}) "
            f"cannot be read ({type(e).__name__}: {str(e)[:300]}); convert the model again into "
            "a new directory"
        ) from None
    if all(x.dtype == a.dtype for x, a in zip(jax.tree.leaves(params), jax.tree.leaves(abstract))):
        return params
    cast = jax.jit(
        lambda p: jax.tree.map(lambda x, a: x.astype(a.dtype), p, abstract),
        out_shardings=shardings,
    )
    return cast(params)


def is_run_dir(path: str | Path) -> bool:
    """Whether `path` is a training run folder (config.yml and an expertax checkpoint folder)."""
    p = Path(path)
    marker = p / CHECKPOINT_SUBDIR / checkpoint.MARKER_FILE
    return (p / "config.yml").is_file() and marker.is_file()


def read_run_config(run_dir: str | Path) -> Config:
    """The Config a run folder saved; ConfigError naming its config.yml when that is damaged,
    empty or not an expertax config, or its checkpoint folder's marker when that is damaged."""
    fix = "put back the config.yml of the command that trained the run"
    try:  # its marker read whole: a damaged one is named, never passed over
        checkpoint.check_directory(Path(run_dir) / CHECKPOINT_SUBDIR)
    except ValueError as e:
        raise ConfigError(f"run folder {run_dir}: {e}") from None
    return build_config(config_file.read_saved(Path(run_dir) / "config.yml", fix))


def latest_run_step(run_dir: str | Path) -> tuple[int | None, dict[int, str]]:
    """The run folder's newest checkpoint that lacks none of its files, and the newer ones that
    do (`checkpoint.latest_intact_step`)."""
    return checkpoint.latest_intact_step(Path(run_dir) / CHECKPOINT_SUBDIR)


def load_run_params(run_dir: str | Path) -> tuple[Config, decoder.Decoder, int]:
    """(Config, parameters on the first device, step) of a run's newest checkpoint that reads.

    Only the parameters are read (the optimizer state stays on disk). A newer checkpoint that
    lacks a file or cannot be read (a damaged array chunk) is named on stderr and the next older
    one read instead; ValueError if the run has no complete checkpoint, ConfigError naming the
    folder if none reads.
    """
    path = Path(run_dir).resolve()
    c = read_run_config(path)
    ckpt_dir = path / CHECKPOINT_SUBDIR
    steps, damaged = checkpoint.intact_steps(ckpt_dir)
    if not steps:
        more = f" (damaged: {damaged})" if damaged else ""
        raise ValueError(f"run folder {path} has no complete checkpoint in {ckpt_dir}{more}")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    dtype = jnp.dtype(c.weight_dtype)
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, dtype, sharding=device),
        decoder.spec(c),
        is_leaf=is_spec,
    )
    read = functools.partial(
        checkpoint.restore_state_field, ckpt_dir, field="params", abstract=abstract
    )
    step, params, unreadable = checkpoint.first_readable(ckpt_dir, steps, read)
    damaged.update({s: f"it cannot be read: {why}" for s, why in unreadable.items()})
    if step is None:
        raise ConfigError(
            f"run folder {path}: no checkpoint in {ckpt_dir} can be read ("
            + "; ".join(f"step {s}: {why}" for s, why in sorted(damaged.items()))
            + "); give another source"
        )
    for newer, what in sorted(damaged.items()):
        if newer > step:
            print(
                f"expertax: the checkpoint of step {newer} in {ckpt_dir} is damaged ({what}); "
                f"reading step {step}",
                file=sys.stderr,
            )
    return c, params, step
