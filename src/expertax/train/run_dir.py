"""The run folder `<base_output_directory>/<run_name>`: inspect it, then open it, then resume.

    inspect(c)            reads only: what the folder holds and what this run will do with it
                          (a new run, a resume from a checkpoint, a restart from step 0), or a
                          ConfigError when it holds a different run; nothing is written
    open_run(c, plan)     the first write: the folder, config.yml, the checkpoint directory
    restore(...)          the train state and data position of the checkpoint to resume

A resume (a complete checkpoint) and a restart (metrics.jsonl but no complete checkpoint yet,
e.g. a run killed in its first minutes) both need the folder's config.yml to agree with this run
on every key of the kinds in `SAME_RUN_KINDS` (the model, the training numbers and the data); the
other keys (layout, run) may change. A restart keeps the earlier metrics.jsonl aside as
metrics.jsonl.1 (.2, ...): nothing is deleted. Every process calls these; process 0 writes.
"""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import datetime
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from expertax.config.loader import config_to_yaml, read_yaml
from expertax.config.schema import SAME_RUN_KINDS, Config, changed_keys
from expertax.errors import ConfigError
from expertax.train import checkpoint, params_io
from expertax.train.state import TrainState
from expertax.train.trainer import Trainer

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yml"


def barrier(name: str) -> None:
    """All processes reach this point before any goes on (no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def with_run_name(c: Config) -> Config:
    """`c` with run_name set: the given one, or process 0's clock as YYYYmmdd-HHMMSS."""
    if c.run_name:
        return c
    stamp = int(time.time())
    if jax.process_count() > 1:  # process 0's clock names the run for every process
        stamp = int(multihost_utils.broadcast_one_to_all(np.int32(stamp)))
    return c.model_copy(
        update={"run_name": datetime.fromtimestamp(stamp).strftime("%Y%m%d-%H%M%S")}
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `inspect` found: the folder, and the step to resume (None: start at step 0)."""

    path: Path
    resume_step: int | None
    restart: bool  # metrics.jsonl of an earlier attempt without a checkpoint: set aside

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / params_io.CHECKPOINT_SUBDIR


def inspect(c: Config) -> Plan:
    """Read the run folder of `c` (run_name resolved) and decide; writes nothing.

    ConfigError when the folder holds another run (a saved config.yml that differs in a key of
    the SAME_RUN_KINDS kinds), metrics without a config.yml, or a checkpoint directory that is
    not expertax's.
    """
    if not c.run_name:
        raise ValueError("inspect() needs a resolved run_name (see with_run_name)")
    path = Path(c.base_output_directory) / c.run_name
    ckpt_dir = path / params_io.CHECKPOINT_SUBDIR
    has_metrics = (path / METRICS_FILE).exists()
    resume = None
    if ckpt_dir.exists():
        try:
            checkpoint.check_directory(ckpt_dir)
        except ValueError as e:
            raise ConfigError(f"run_name={c.run_name!r}: {e}") from None
        resume = checkpoint.latest_step(ckpt_dir)
    saved = _saved_values(path)
    if saved is None and has_metrics:
        raise ConfigError(
            f"run_name={c.run_name!r}: {path} holds a {METRICS_FILE} but no {CONFIG_FILE}, so "
            "whose run it is cannot be checked; choose another run_name"
        )
    if saved is not None:
        diffs = changed_keys(saved, c, SAME_RUN_KINDS)
        if diffs:
            what = f"a checkpoint of step {resume}" if resume is not None else "no checkpoint yet"
            raise ConfigError(
                f"run_name={c.run_name!r}: {path} holds a run ({what}) saved with different "
                f"values of keys that change the model, the training or the data "
                f"({'; '.join(diffs)}); continue it with the saved values ({path / CONFIG_FILE}) "
                "or choose another run_name"
            )
    return Plan(path, resume, restart=resume is None and has_metrics)


def _saved_values(path: Path) -> dict | None:
    config = path / CONFIG_FILE
    return read_yaml(config) if config.exists() else None


@dataclasses.dataclass
class RunDir:
    """An opened run folder: its checkpoints (None: none to save or resume) and the resume step."""

    path: Path
    checkpointer: checkpoint.Checkpointer | None
    resume_step: int | None
    saving: bool  # enable_checkpointing: save checkpoints of this run
    restarted: bool = False  # an earlier attempt's metrics were set aside
    last_saved: int = 0  # the step of the newest checkpoint (the resume step at the start)

    def should_save(self, step: int, *, force: bool) -> bool:
        """Whether step `step` (steps done) is saved now: due by the period, or forced."""
        if not self.saving or self.checkpointer is None or step == self.last_saved:
            return False
        return self.checkpointer.should_save(step, force=force)

    def save(self, step: int, state: TrainState, data_state: dict) -> None:
        assert self.checkpointer is not None
        self.checkpointer.maybe_save(step, state, data_state, force=True)
        self.last_saved = step

    def close(self) -> None:
        """Wait for the last save and release the checkpointer."""
        if self.checkpointer is not None:
            self.checkpointer.close()


def open_run(c: Config, plan: Plan) -> RunDir:
    """Create or reopen the folder of `plan`: config.yml written, metrics trimmed to the resume
    step or set aside for a restart, the checkpoint directory marked and opened."""
    ckpt_dir = plan.checkpoint_dir
    barrier("expertax:inspected-run-dir")  # everyone looked before process 0 writes
    use_checkpoints = c.enable_checkpointing or ckpt_dir.exists()
    if jax.process_index() == 0:
        plan.path.mkdir(parents=True, exist_ok=True)
        (plan.path / CONFIG_FILE).write_text(config_to_yaml(c))
        metrics = plan.path / METRICS_FILE
        if plan.resume_step is not None:
            _trim_metrics(metrics, plan.resume_step)
        elif plan.restart:
            _set_aside(metrics)
        if use_checkpoints:
            checkpoint.mark_directory(ckpt_dir)
    barrier("expertax:run-dir-ready")
    ckpt = None
    if use_checkpoints:
        try:
            ckpt = checkpoint.Checkpointer(
                ckpt_dir,
                period_steps=c.checkpoint_period,
                max_to_keep=c.max_checkpoints,
                enable_async=c.async_checkpointing,
            )
        except ValueError as e:
            raise ConfigError(f"run_name={c.run_name!r}: {e}") from None
    return RunDir(
        plan.path,
        ckpt,
        plan.resume_step,
        saving=ckpt is not None and c.enable_checkpointing,
        restarted=plan.restart,
        last_saved=plan.resume_step or 0,
    )


def _trim_metrics(path: Path, step: int) -> None:
    """Keep the records of steps before `step` (the restored state's), so the file stays one record
    per step after the resumed run appends; a record cut off by a crash is dropped too."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] < step:
            kept.append(line + "\n")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    tmp.rename(path)


def _set_aside(path: Path) -> Path | None:
    """Rename `path` to the first free `<path>.N` (N = 1, 2, ...); None if there is no file."""
    if not path.exists():
        return None
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    target = path.with_name(f"{path.name}.{n}")
    path.rename(target)
    return target


def restore(c: Config, trainer: Trainer, run: RunDir, data) -> tuple[TrainState, int]:
    """The train state of run.resume_step (resharded onto trainer's mesh); positions `data`.

    Returns the state and the count of skipped (non-finite) steps so far.
    """
    step = run.resume_step
    assert run.checkpointer is not None and step is not None
    state, saved = run.checkpointer.restore(step, trainer.abstract_state())
    saved = saved or {}
    if saved.get("global_batch") != trainer.global_batch:
        raise ConfigError(
            f"the checkpoint of step {step} was trained with a global batch of "
            f"{saved.get('global_batch')} sequences; this run has {trainer.global_batch} "
            f"(per_device_batch_size={c.per_device_batch_size} x {trainer.num_devices} devices); "
            "set per_device_batch_size so that the global batch is the same"
        )
    iterators = saved["iterators"]
    if len(iterators) not in (1, jax.process_count()):
        raise ConfigError(
            f"the checkpoint of step {step} was saved by {len(iterators)} processes reading "
            "files; resume dataset_type=files with the same number of processes, not "
            f"{jax.process_count()}"
        )
    try:
        data.set_state(iterators[jax.process_index() if len(iterators) > 1 else 0])
    except (ValueError, KeyError) as e:
        raise ConfigError(f"cannot resume the data position of step {step}: {e}") from None
    return state, int(saved.get("skipped_steps", 0))
