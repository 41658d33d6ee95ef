"""`train(c)`: the training loop, top to bottom.

Every check of the user's input (mesh, run folder, data, tokenizer, model directory) runs before
the run folder is written; then the step is compiled and run. Metrics are fetched one step late:
step i+1 is dispatched before step i's metrics are read, so the host never stalls the device;
`step_time_s` is the time between consecutive fetches.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

from expertax.config.schema import Config
from expertax.models import stashed_stack
from expertax.nn.moe.strategy import describe_dispatch
from expertax.train import inputs, params_io, run_dir
from expertax.train import metrics as metrics_lib
from expertax.train.run_dir import RunDir
from expertax.train.state import TrainState
from expertax.train.step import NonFiniteError
from expertax.train.trainer import Trainer, build_trainer

Say = Callable[[str], None]


@dataclasses.dataclass
class Prepared:
    """A run ready to compile: its config (run_name resolved), trainer, data and open folder."""

    c: Config
    trainer: Trainer
    data: Any
    run: RunDir


def prepare(c: Config, devices=None) -> Prepared:
    """Check everything the user gave, then open the run folder (the first write).

    The mesh, the run folder (a different run there is refused), the tokenizer, the data files
    and the model directory of load_parameters_path are all checked before anything is written,
    so a refused run leaves nothing behind.
    """
    trainer = build_trainer(c, devices)  # the mesh, rules and shardings
    c = run_dir.with_run_name(c)
    plan = run_dir.inspect(c)  # the run folder, read only
    if c.dataset_type == "files":
        inputs.check_tokenizer_vocab(c)
    data = inputs.make_data(c, trainer)  # data paths, tokenizer, text field
    if plan.resume_step is None and c.load_parameters_path:
        params_io.check_model_dir(c)
    run = run_dir.open_run(c, plan)  # the first write
    return Prepared(c, trainer, data, run)


def train(c: Config, *, echo=print, devices=None, stop_after_step: int | None = None) -> dict:
    """Train `c` and return a summary dict; writes metrics.jsonl and config.yml in the run dir.

    Re-running the same config (same run_name) resumes from the latest complete checkpoint, or
    restarts from step 0 if the run stopped before its first one. `devices`: the devices of the
    mesh (default: all). `stop_after_step`: end after this many steps of the run in all, with a
    checkpoint, as a preemption would; the run stays resumable.
    """
    t0 = time.perf_counter()
    p = prepare(c, devices)
    c, run = p.c, p.run
    say: Say = echo if jax.process_index() == 0 else (lambda *_: None)
    say(
        f"expertax: {c.model_name} on {p.trainer.num_devices} {jax.default_backend()} devices, "
        f"mesh {dict(p.trainer.mesh.shape)}, global batch {p.trainer.global_batch} x "
        f"{c.max_target_length}, run dir {run.path}"
    )
    if run.resume_step is None and run.restarted:
        say(f"restarting from step 0: {run.path} had no complete checkpoint yet")
    try:
        return _train(c, p.trainer, run, p.data, say, t0, stop_after_step)
    finally:
        run.close()  # waits for the last save


def _train(c, trainer: Trainer, run: RunDir, data, say: Say, t0: float, stop_after_step) -> dict:
    state, skipped = _starting_state(c, trainer, run, data, say)
    start = run.resume_step or 0
    step_fn = trainer.compile()
    say(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    say(describe_dispatch(c, dict(trainer.mesh.shape), trainer.rules))
    end = c.steps if stop_after_step is None else min(c.steps, stop_after_step)
    log = StepLog(c, trainer, run, say, skipped)
    done = start
    with trainer.context():
        for step in range(start, end):
            try:
                batch = next(data)
            except StopIteration:
                say(f"data exhausted (data_num_epochs={c.data_num_epochs}) before step {step}")
                break
            state, device_metrics = step_fn(state, trainer.put_batch(batch))
            done = step + 1
            log.push(step, device_metrics)  # reads the previous step's metrics
            _maybe_save(c, trainer, run, log, data, done, state, force=done == end)
        _maybe_save(c, trainer, run, log, data, done, state, force=True)  # also if data ran out
        log.flush()
    return _summary(c, trainer, run, log, state, data, say)


def _starting_state(c, trainer: Trainer, run: RunDir, data, say: Say) -> tuple[TrainState, int]:
    """(state, skipped steps so far): the checkpoint's, or step 0's with random or loaded
    parameters and a fresh optimizer state."""
    if run.resume_step is not None:
        state, skipped = run_dir.restore(c, trainer, run, data)
        say(f"resumed from the checkpoint of step {run.resume_step} in {run.path}")
        if c.load_parameters_path:
            say(f"load_parameters_path={c.load_parameters_path!r} ignored: the checkpoint wins")
        return state, skipped
    if not c.load_parameters_path:
        return trainer.init_state(), 0
    abstract = trainer.abstract_state().params
    params = params_io.load_params(c, trainer.state_shardings.params, abstract)
    say(f"loaded the parameters of {c.load_parameters_path} (fresh optimizer state, step 0)")
    return trainer.init_state(params), 0


def _maybe_save(c, trainer, run: RunDir, log: StepLog, data, done: int, state, *, force) -> None:
    if not run.should_save(done, force=force):
        return
    log.flush()  # a non-finite step must stop the run before its state is saved
    run.save(done, state, inputs.data_state(c, trainer, data, log.skipped))


class StepLog:
    """Turns each step's device metrics into a record (metrics.jsonl, console), one step late."""

    def __init__(self, c: Config, trainer: Trainer, run: RunDir, say: Say, skipped: int):
        self.c, self.say, self.skipped = c, say, skipped
        self.devices = trainer.num_devices
        self.tokens = trainer.global_batch * c.max_target_length
        self.flops_per_token = metrics_lib.train_flops_per_token(c)
        self.writer = metrics_lib.MetricsWriter(run.path if jax.process_index() == 0 else None)
        self.records: list[dict] = []
        self.pending: tuple[int, dict] | None = None
        self.t_prev = time.perf_counter()
        self.stash_overflowed = False

    def push(self, step: int, device_metrics: dict) -> None:
        """Record the pending step (its metrics are ready by now) and hold this one."""
        self.flush()
        self.pending = (step, device_metrics)

    def flush(self) -> None:
        if self.pending is not None:
            step, device_metrics = self.pending
            self.pending = None
            self._record(step, device_metrics)

    def _record(self, step: int, device_metrics: dict) -> None:
        host = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
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
        self.records.append(rec)
        self.writer.write(rec)
        if host["nonfinite"]:
            self._nonfinite(step, host)
        if host.get("stash_overflow_layers"):
            self._stash_overflow(step, host)
        if step % self.c.log_period == 0 or step == self.c.steps - 1:
            self.say(metrics_lib.console_line(rec))

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
    say(
        f"done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, median step "
        f"{median:.3f} s, {summary['tokens_per_s_per_device']:.0f} tokens/s/device"
        + (f", {log.skipped} non-finite steps skipped" if log.skipped else "")
    )
    return summary
