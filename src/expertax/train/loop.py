"""`train(c)`: the training loop, top to bottom.

Every check of the user's input (mesh, run folder, data and its first batch, tokenizer, the
parameters of load_parameters_path) and the compilation of the step run before the run folder is
written; then the step runs. Metrics are fetched one step late: step i+1 is dispatched before step
i's metrics are read, so the host never stalls the device; `step_time_s` is the time between
consecutive fetches.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from expertax import progress
from expertax.config.loader import config_to_yaml
from expertax.config.schema import Config
from expertax.models import stashed_stack
from expertax.nn.moe.strategy import describe_dispatch
from expertax.train import inputs, params_io, run_dir
from expertax.train import metrics as metrics_lib
from expertax.train.evaluate import Evaluator
from expertax.train.profile import Profiler
from expertax.train.run_dir import RunDir
from expertax.train.state import TrainState
from expertax.train.step import NonFiniteError
from expertax.train.tensorboard import TensorBoardWriter
from expertax.train.trainer import Trainer, build_trainer

Say = Callable[[str], None]


@dataclasses.dataclass
class Prepared:
    """A run ready to train: its config (run_name resolved), trainer, data (and held-out data
    when eval_interval > 0) and open folder; the parameters of load_parameters_path when a new
    run starts from them; the compiled step and evaluator when `prepare` compiled them."""

    c: Config
    trainer: Trainer
    data: Any
    run: RunDir
    eval_data: Any = None
    params: Any = None
    compiled: tuple[Any, Evaluator | None] | None = None


def prepare(c: Config, devices=None, *, compile_step: bool = False) -> Prepared:
    """Check everything the user gave, then open the run folder (the first write).

    The mesh, the run folder (a different run there is refused), the tokenizer, the data files
    (their first batch is read), the parameters of load_parameters_path and, with
    `compile_step` (as `train` does), the compiled step and evaluation are all checked before
    anything is written, so a refused run leaves nothing behind.
    """
    trainer = build_trainer(c, devices)  # the mesh, rules and shardings
    c = run_dir.with_run_name(c)
    plan = run_dir.inspect(c)  # the run folder, read only
    if c.dataset_type == "files" or (c.eval_interval and c.eval_dataset_path):
        inputs.check_tokenizer_vocab(c)
    data = inputs.make_data(c, trainer)  # data paths, tokenizer, text field
    inputs.check_first_batch(data)
    eval_data = inputs.make_eval_data(c, trainer) if c.eval_interval else None
    if eval_data is not None:
        inputs.check_first_batch(eval_data, "the evaluation data")
    params = None
    if plan.resume_step is None and c.load_parameters_path:
        abstract = trainer.abstract_state().params
        params = params_io.load_params(c, trainer.state_shardings.params, abstract)
    # a program XLA refuses (one too large for the memory, say) is refused before the write
    compiled = compile_run(c, trainer, eval_data) if compile_step else None
    run = run_dir.open_run(c, plan)  # the first write
    return Prepared(c, trainer, data, run, eval_data, params, compiled)


def compile_run(c: Config, trainer: Trainer, eval_data) -> tuple[Any, Evaluator | None]:
    """The compiled train step, and the compiled evaluation when there is held-out data."""
    evaluator = Evaluator(c, trainer, eval_data) if eval_data is not None else None
    return trainer.compile(), evaluator


def train(c: Config, *, echo=print, devices=None, stop_after_step: int | None = None) -> dict:
    """Train `c` and return a summary dict; writes metrics.jsonl and config.yml in the run dir.

    Re-running the same config (same run_name) resumes from the latest complete checkpoint, or
    restarts from step 0 if the run stopped before its first one. `devices`: the devices of the
    mesh (default: all). `stop_after_step`: end after this many steps of the run in all, with a
    checkpoint, as a preemption would; the run stays resumable.
    """
    t0 = time.perf_counter()
    p = prepare(c, devices, compile_step=True)
    c, run = p.c, p.run
    say: Say = echo if jax.process_index() == 0 else (lambda *_: None)
    if jax.process_index() == 0:
        for note in run.notes():  # a replaced folder, a damaged checkpoint skipped
            print(f"expertax: {note}", file=sys.stderr)
    say(
        f"expertax: {c.model_name} on {p.trainer.num_devices} {jax.default_backend()} devices, "
        f"mesh {dict(p.trainer.mesh.shape)}, global batch {p.trainer.global_batch} x "
        f"{c.max_target_length}, run dir {run.path}"
    )
    if run.resume_step is None and run.restarted and not run.replaced:
        say(f"restarting from step 0: {run.path} had no complete checkpoint yet")
    try:
        return _train(p, say, t0, stop_after_step)
    finally:
        run.close()  # waits for the last save


def _train(p: Prepared, say: Say, t0: float, stop_after_step) -> dict:
    c, trainer, run, data = p.c, p.trainer, p.run, p.data
    state, skipped = _starting_state(p, say)
    start = run.resume_step or 0
    step_fn, evaluator = p.compiled or compile_run(c, trainer, p.eval_data)
    say(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    say(describe_dispatch(c, dict(trainer.mesh.shape), trainer.rules))
    end = c.steps if stop_after_step is None else min(c.steps, stop_after_step)
    bar = progress.bar(end, "train", initial=start, unit="step", off=jax.process_index() != 0)
    say = progress.say_above(bar, say)
    log = StepLog(c, trainer, run, say, skipped)
    profiler = Profiler(c, run.path, start)
    done = start
    try:
        with trainer.context():
            for step in range(start, end):
                try:
                    batch = inputs.next_batch(data, f"step {step}")
                except StopIteration:
                    say(f"data exhausted (data_num_epochs={c.data_num_epochs}) before step {step}")
                    break
                profiler.before(step)
                state, device_metrics = step_fn(state, trainer.put_batch(batch))
                profiler.after(step, state)
                done = step + 1
                log.push(step, device_metrics)  # reads the previous step's metrics
                if evaluator is not None and evaluator.due(done):  # before `state` is donated
                    log.flush(evaluate=functools.partial(evaluator.run, state.params))
                bar.update(1)
                _maybe_save(c, trainer, run, log, data, done, state, force=done == end)
            _maybe_save(c, trainer, run, log, data, done, state, force=True)  # if data ran out
            log.flush()
    finally:
        profiler.stop()
        log.close()
        bar.close()
    return _summary(c, trainer, run, log, state, data, say)


def _starting_state(p: Prepared, say: Say) -> tuple[TrainState, int]:
    """(state, skipped steps so far): the checkpoint's, or step 0's with random or loaded
    parameters and a fresh optimizer state."""
    c, trainer, run = p.c, p.trainer, p.run
    if run.resume_step is not None:
        state, skipped = run_dir.restore(c, trainer, run, p.data)
        say(f"resumed from the checkpoint of step {run.resume_step} in {run.path}")
        if c.load_parameters_path:
            say(f"load_parameters_path={c.load_parameters_path!r} ignored: the checkpoint wins")
        return state, skipped
    if p.params is None:
        return trainer.init_state(), 0
    say(f"loaded the parameters of {c.load_parameters_path} (fresh optimizer state, step 0)")
    return trainer.init_state(p.params), 0


def _maybe_save(c, trainer, run: RunDir, log: StepLog, data, done: int, state, *, force) -> None:
    if not run.should_save(done, force=force):
        return
    log.flush()  # a non-finite step must stop the run before its state is saved
    run.save(done, state, inputs.data_state(c, trainer, data, log.skipped))


class StepLog:
    """Turns each step's device metrics into a record (metrics.jsonl, TensorBoard, console), one
    step late. At log_period the record also holds the per-MoE-layer expert loads."""

    def __init__(self, c: Config, trainer: Trainer, run: RunDir, say: Say, skipped: int):
        self.c, self.say, self.skipped = c, say, skipped
        self.devices = trainer.num_devices
        self.tokens = trainer.global_batch * c.max_target_length
        self.flops_per_token = metrics_lib.train_flops_per_token(c)
        first = jax.process_index() == 0
        self.writer = metrics_lib.MetricsWriter(run.path if first else None)
        tb_path = run.path if first and c.enable_tensorboard else None
        self.tensorboard = TensorBoardWriter(tb_path, config_to_yaml(c))
        self.records: list[dict] = []
        self.pending: tuple[int, dict] | None = None
        self.t_prev = time.perf_counter()
        self.stash_overflowed = False

    def push(self, step: int, device_metrics: dict) -> None:
        """Record the pending step (its metrics are ready by now) and hold this one."""
        self.flush()
        self.pending = (step, device_metrics)

    def flush(self, evaluate: Callable[[], dict] | None = None) -> None:
        """Record the pending step; `evaluate()` (an evaluation of its state) adds to its record,
        and its time is left out of the next step's step_time_s."""
        if self.pending is not None:
            step, device_metrics = self.pending
            self.pending = None
            self._record(step, device_metrics, evaluate)

    def close(self) -> None:
        self.tensorboard.close()

    def _record(self, step: int, device_metrics: dict, evaluate) -> None:
        host = jax.device_get(device_metrics)
        load_LE = host.pop("expert_load", None)
        # scalars; a per-layer array (QK-clip's largest logits) as a list in metrics.jsonl
        host = {
            k: float(v) if np.ndim(v) == 0 else np.asarray(v, float).tolist()
            for k, v in host.items()
        }
        now = time.perf_counter()
        dt, self.t_prev = now - self.t_prev, now
        per_device_rate = self.tokens / dt / self.devices
        if host["nonfinite"] and self.c.skip_nonfinite_steps:
            self.skipped += 1
        rec = {
            "step": step,
            **host,
            "perplexity": metrics_lib.perplexity(host["loss"]),
            "step_time_s": dt,
            "tokens_per_s_per_device": per_device_rate,
            "tflops_per_device": self.flops_per_token * per_device_rate / 1e12,
            "skipped_steps": self.skipped,
        }
        if self.c.quantization:
            rec["fp8_gemm_flops_fraction"] = metrics_lib.fp8_flops_fraction(self.c)
        if evaluate is not None:
            rec.update(evaluate())
            self.t_prev = time.perf_counter()
        self.tensorboard.scalars(rec)
        logged = step % self.c.log_period == 0 or step == self.c.steps - 1
        if logged and load_LE is not None:
            rec["expert_load"] = metrics_lib.compact_expert_load(load_LE)
            self.tensorboard.expert_loads(step, load_LE)
        if logged:
            self.tensorboard.device_memory(step, jax.local_devices()[0].memory_stats())
        self.records.append(rec)
        self.writer.write(rec)
        if host["nonfinite"]:
            self._nonfinite(step, host)
        if host.get("stash_overflow_layers"):
            self._stash_overflow(step, host)
        if logged:
            self.say(metrics_lib.console_line(rec))
        if evaluate is not None:
            self.say(metrics_lib.eval_console_line(rec))

    def _stash_overflow(self, step: int, host: dict) -> None:
        """Name the stash capacity that would have fit: on the first overflow, then at log lines."""
        first, self.stash_overflowed = not self.stash_overflowed, True
        if first or step % self.c.log_period == 0:
            note = stashed_stack.capacity_factor_note(host["stash_capacity_factor_needed"], self.c)
            self.say(f"step {step}: {int(host['stash_overflow_layers'])} MoE layer(s): {note}")

    def _nonfinite(self, step: int, host: dict) -> None:
        what = f"loss {host['loss']}, load-balance loss {host['lb_loss']}, "
        what += f"grad norm {host['grad_norm']}"
        if not self.c.skip_nonfinite_steps:
            raise NonFiniteError(
                f"step {step}: non-finite {what}; the update was not applied and the run stops "
                "(the checkpoints hold finite states only). Set skip_nonfinite_steps=true to skip "
                "such updates instead, or lower learning_rate"
            )
        self.say(f"step {step}: non-finite {what}; update skipped ({self.skipped} skipped so far)")


def _summary(c: Config, trainer: Trainer, run: RunDir, log: StepLog, state, data, say) -> dict:
    records = log.records
    summary = {
        "run_dir": str(run.path),
        "steps": c.steps,
        "resumed_from": run.resume_step,
        "skipped_steps": log.skipped,
        "devices": trainer.num_devices,
        "state": state,
        "data_state": data.get_state(),
    }
    if not records:
        say(f"nothing to do: the run is at step {run.resume_step} of {c.steps}")
        return summary
    steady = [r["step_time_s"] for r in records[2:]] or [r["step_time_s"] for r in records]
    median = statistics.median(steady)
    summary.update(
        first_loss=records[0]["loss"],
        final_loss=records[-1]["loss"],
        final_perplexity=records[-1]["perplexity"],
        median_step_time_s=median,
        tokens_per_s_per_device=log.tokens / median / trainer.num_devices,
    )
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        summary.update(final_eval_loss=evals[-1]["eval_loss"])
    say(
        f"done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, median step "
        f"{median:.3f} s, {summary['tokens_per_s_per_device']:.0f} tokens/s/device"
        + (f", eval loss {evals[-1]['eval_loss']:.4f}" if evals else "")
        + (f", {log.skipped} non-finite steps skipped" if log.skipped else "")
    )
    return summary
