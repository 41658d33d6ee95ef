"""The run folder `<base_output_directory>/<run_name>`: inspect it, then open it, then resume.

    inspect(c)            reads only: what the folder holds and what this run will do with it
                          (a new run, a resume from a checkpoint, a restart from step 0), or a
                          ConfigError when it holds a different run; nothing is written
    open_run(c, plan)     the first write: the folder, config.yml, the checkpoint directory
    restore(...)          the train state and data position of the checkpoint to resume

A folder trained once it holds a complete checkpoint or the metrics record of a step. A resume (a
complete checkpoint) and a restart (metrics.jsonl but no complete checkpoint yet, e.g. a run killed
in its first minutes) both need the folder's config.yml to be readable and to agree with this run
on every key of the kinds in `SAME_RUN_KINDS` (the model, the training numbers and the data); the
other keys (layout, run) may change. A folder that never trained a step (a run that failed before
its first one) is started again with whatever config comes next. A restart keeps the earlier
metrics.jsonl aside as metrics.jsonl.1 (.2, ...), and the newest checkpoints found damaged (files
missing, or a restore that fails) go to `damaged_checkpoints/<step>` while the run resumes from
the newest one that reads: nothing is deleted.
Every process calls these; process 0 writes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from datetime import datetime
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from expertax import paths
from expertax.config.loader import config_to_yaml
from expertax.config.schema import SAME_RUN_KINDS, Config, changed_keys
from expertax.errors import ConfigError
from expertax.train import checkpoint, config_file, params_io
from expertax.train.state import TrainState
from expertax.train.trainer import Trainer

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yml"
DAMAGED_DIR = "damaged_checkpoints"  # where open_run moves the damaged checkpoints it skips


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
    """What `inspect` found: the folder, the step to resume (None: start at step 0), and the
    checkpoints newer than it that are damaged (set aside by `open_run`, step -> what is wrong)."""

    path: Path
    resume_step: int | None
    restart: bool  # metrics.jsonl of an earlier attempt without a checkpoint: set aside
    replaced: bool = False  # a folder that never trained a step, started again with this config
    damaged: dict[int, str] = dataclasses.field(default_factory=dict)

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / params_io.CHECKPOINT_SUBDIR


def inspect(c: Config) -> Plan:
    """Read the run folder of `c` (run_name resolved) and decide; writes nothing.

    A folder that trained (a complete checkpoint, or a metrics record of a step) must hold a
    readable config.yml equal to this run's in every key of the SAME_RUN_KINDS kinds: otherwise
    ConfigError. A folder that never trained a step (a run refused or killed before its first
    step) is started again with this config. A checkpoint directory that is not expertax's is
    refused either way.
    """
    if not c.run_name:
        raise ValueError("inspect() needs a resolved run_name (see with_run_name)")
    path = Path(c.base_output_directory) / c.run_name
    ckpt_dir = path / params_io.CHECKPOINT_SUBDIR
    has_metrics = (path / METRICS_FILE).exists()
    resume: int | None = None
    damaged: dict[int, str] = {}
    if ckpt_dir.exists():
        try:
            checkpoint.check_directory(ckpt_dir)
        except ValueError as e:
            raise ConfigError(f"run_name={c.run_name!r}: {e}") from None
        resume, damaged = checkpoint.latest_intact_step(ckpt_dir)
    if resume is None and damaged:
        raise ConfigError(
            f"run_name={c.run_name!r}: every checkpoint in {ckpt_dir} is damaged ("
            + "; ".join(f"step {s}: {why}" for s, why in sorted(damaged.items()))
            + f"); move {ckpt_dir} aside to train {path} again from step 0, or choose another "
            "run_name"
        )
    if resume is not None and has_metrics:  # trimmed to the resume step by open_run
        paths.decode(
            (path / METRICS_FILE).read_bytes(),
            f"run_name={c.run_name!r}: {path / METRICS_FILE}",
            "it is damaged: move it aside to resume without the earlier steps' records, or "
            "choose another run_name",
        )
    trained = resume is not None or _has_step_records(path)
    refusal = _other_run(c, path, resume, has_metrics)
    if refusal is not None and trained:
        raise ConfigError(refusal)
    return Plan(
        path,
        resume,
        restart=resume is None and has_metrics,
        replaced=refusal is not None,
        damaged=damaged,
    )


def _other_run(c: Config, path: Path, resume: int | None, has_metrics: bool) -> str | None:
    """Why the folder cannot be this run's (its config.yml differs, is damaged or is missing
    beside metrics); None when it can."""
    config = path / CONFIG_FILE
    what = f"a checkpoint of step {resume}" if resume is not None else "no checkpoint yet"
    if not config.exists():
        if not has_metrics:
            return None
        return (
            f"run_name={c.run_name!r}: {path} holds a {METRICS_FILE} but no {CONFIG_FILE}, so "
            "whose run it is cannot be checked; choose another run_name"
        )
    saved, wrong = config_file.read(config)
    if wrong is not None:
        return (
            f"run_name={c.run_name!r}: {config} {wrong}, so whose run {path} holds ({what}) "
            f"cannot be checked; put back the {CONFIG_FILE} of the command that trained it to "
            "continue that run, or choose another run_name"
        )
    diffs = changed_keys(saved, c, SAME_RUN_KINDS)
    if not diffs:
        return None
    return (
        f"run_name={c.run_name!r}: {path} holds a run ({what}) saved with different "
        f"values of keys that change the model, the training or the data "
        f"({'; '.join(diffs)}); continue it with the saved values ({config}) "
        "or choose another run_name"
    )


def _has_step_records(path: Path) -> bool:
    """Whether a metrics file of the folder (metrics.jsonl, or one set aside by a restart) holds
    the record of a step."""
    for metrics in sorted(path.glob(f"{METRICS_FILE}*")):
        with open(metrics, "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                    return True
    return False


@dataclasses.dataclass
class RunDir:
    """An opened run folder: its checkpoints (None: none to save or resume) and the resume step."""

    path: Path
    checkpointer: checkpoint.Checkpointer | None
    resume_step: int | None
    saving: bool  # enable_checkpointing: save checkpoints of this run
    restarted: bool = False  # an earlier attempt's metrics were set aside
    last_saved: int = 0  # the step of the newest checkpoint (the resume step at the start)
    replaced: bool = False  # a folder that never trained a step, started again with this config
    # damaged checkpoints newer than the resume step: step -> (what was wrong, where it went now)
    set_aside: dict[int, tuple[str, Path]] = dataclasses.field(default_factory=dict)

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

    def set_aside_note(self, step: int) -> str:
        why, where = self.set_aside[step]
        return (
            f"the checkpoint of step {step} in {self.path} is damaged ({why}); moved to {where}, "
            f"resuming from step {self.resume_step}, the newest checkpoint that reads"
        )

    def notes(self) -> list[str]:
        """What the opening did that the user must hear of (the CLI prints them on stderr)."""
        out = [self.set_aside_note(step) for step in sorted(self.set_aside)]
        if self.replaced:
            out.append(
                f"run folder {self.path} never trained a step; starting it again with the new "
                "config"
            )
        return out


def open_run(c: Config, plan: Plan) -> RunDir:
    """Create or reopen the folder of `plan`: config.yml written, metrics trimmed to the resume
    step or set aside for a restart, damaged checkpoints moved out of the checkpoint directory
    (to `damaged_checkpoints/`), the checkpoint directory marked and opened."""
    ckpt_dir = plan.checkpoint_dir
    barrier("expertax:inspected-run-dir")  # everyone looked before process 0 writes
    use_checkpoints = c.enable_checkpointing or ckpt_dir.exists()
    set_aside = {
        step: (why, _free_name(plan.path / DAMAGED_DIR / str(step)))
        for step, why in plan.damaged.items()
    }
    if jax.process_index() == 0:
        plan.path.mkdir(parents=True, exist_ok=True)
        (plan.path / CONFIG_FILE).write_text(config_to_yaml(c))
        metrics = plan.path / METRICS_FILE
        for step, (_, target) in set_aside.items():
            target.parent.mkdir(exist_ok=True)
            checkpoint.step_path(ckpt_dir, step).rename(target)
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
        replaced=plan.replaced,
        set_aside=set_aside,
    )


def _everyone(read_here: bool) -> bool:
    """Whether every process read its part of a checkpoint."""
    if jax.process_count() == 1:
        return read_here
    return bool(np.all(multihost_utils.process_allgather(np.int32(read_here))))


def _fall_back(run: RunDir, step: int, unreadable: dict[int, str]) -> None:
    """Resume from `step` instead: the newer checkpoints that did not read moved to
    `damaged_checkpoints/`, the metrics trimmed to `step`, each move said on stderr."""
    assert run.checkpointer is not None
    moved = {
        s: (f"it cannot be read: {why}", _free_name(run.path / DAMAGED_DIR / str(s)))
        for s, why in unreadable.items()
    }
    if jax.process_index() == 0:
        for s, (_, target) in moved.items():
            target.parent.mkdir(exist_ok=True)
            checkpoint.step_path(run.checkpointer.directory, s).rename(target)
        _trim_metrics(run.path / METRICS_FILE, step)
    barrier("expertax:unreadable-checkpoints-set-aside")
    run.checkpointer.reload()
    run.resume_step = run.last_saved = step
    run.set_aside.update(moved)
    if jax.process_index() == 0:
        for s in sorted(moved):
            print(f"expertax: {run.set_aside_note(s)}", file=sys.stderr)


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
    target = _free_name(path, first=1)
    path.rename(target)
    return target


def _free_name(path: Path, first: int = 0) -> Path:
    """The first of `path` (from first=0 only), `<path>.1`, `<path>.2`, ... that does not exist."""
    n = first
    while (candidate := path.with_name(f"{path.name}.{n}") if n else path).exists():
        n += 1
    return candidate


def restore(c: Config, trainer: Trainer, run: RunDir, data) -> tuple[TrainState, int]:
    """The train state of run.resume_step (resharded onto trainer's mesh); positions `data`.

    A checkpoint that cannot be read (an array chunk cut short or overwritten: nothing
    `checkpoint.damage` sees) is set aside as the damaged ones are, and the next older intact one
    is read instead (`_fall_back`); none that reads is a ConfigError naming the folder.
    Returns the state and the count of skipped (non-finite) steps so far.
    """
    ckpt = run.checkpointer
    assert ckpt is not None and run.resume_step is not None
    abstract = trainer.abstract_state()
    older = [s for s in checkpoint.intact_steps(ckpt.directory)[0] if s < run.resume_step]
    read = functools.partial(ckpt.restore, abstract_state=abstract)
    steps = [run.resume_step, *older]
    step, got, unreadable = checkpoint.first_readable(ckpt.directory, steps, read, _everyone)
    if step is None:
        raise ConfigError(
            f"no checkpoint in {ckpt.directory} can be read ("
            + "; ".join(f"step {s}: {why}" for s, why in sorted(unreadable.items()))
            + f"); move {ckpt.directory} aside to train {run.path} again from step 0, or choose "
            "another run_name"
        )
    if unreadable:
        _fall_back(run, step, unreadable)
    state, saved = got
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
