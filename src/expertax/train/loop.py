"""Build the sharded, compiled train step and run the training loop.

Metrics are fetched one step late: step i+1 is dispatched before step i's metrics are read, so
the host never stalls the device. `step_time_s` is the time between consecutive fetches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import statistics
import time
from datetime import datetime
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from optax.transforms._masking import MaskedNode

from expertax.config.checks import ConfigError
from expertax.config.loader import config_to_yaml
from expertax.config.schema import Config
from expertax.data import files, tokenizer
from expertax.data.synthetic import SyntheticData
from expertax.models import decoder, init_params
from expertax.nn import param
from expertax.nn.moe.strategy import describe_dispatch
from expertax.parallel import remat
from expertax.sharding import config_rules, logical_to_spec, make_mesh, use_rules
from expertax.train import checkpoint, optimizer, params_io
from expertax.train import metrics as metrics_lib
from expertax.train.state import TrainState
from expertax.train.step import NonFiniteError, train_step

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


@dataclasses.dataclass
class Trainer:
    """Everything needed to run (or only compile) the train step for a config on a mesh."""

    c: Config
    mesh: jax.sharding.Mesh
    rules: dict
    tx: optax.GradientTransformation
    state_shardings: TrainState
    batch_sharding: NamedSharding
    global_batch: int
    # With parameter/optimizer host offload: the same shardings in device memory, where the
    # step moves the offloaded state before computing (None when nothing is offloaded).
    device_state_shardings: TrainState | None = None

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    def context(self):
        """Mesh and rules active while tracing."""
        return _mesh_and_rules(self.mesh, self.rules)

    def abstract_batch(self) -> dict:
        shape = (self.global_batch, self.c.max_target_length)
        dt = {"weights": jnp.float32}
        return {
            k: jax.ShapeDtypeStruct(shape, dt.get(k, jnp.int32), sharding=self.batch_sharding)
            for k in BATCH_KEYS
        }

    def abstract_state(self) -> TrainState:
        params = param.abstract(decoder.spec(self.c), jnp.dtype(self.c.weight_dtype))
        shapes = jax.eval_shape(
            lambda p: TrainState(jnp.int32(0), p, self.tx.init(p), jax.random.key(0)), params
        )
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            shapes,
            self.state_shardings,
        )

    def init_state(self, params: decoder.Decoder | None = None) -> TrainState:
        """Step 0 with a fresh optimizer state; random parameters (init_weights_seed) unless
        `params` are given (in `state_shardings.params` and the run's weight_dtype)."""
        with self.context():
            if params is None:
                params = init_params(self.c, shardings=self.state_shardings.params)
            opt_state = jax.jit(self.tx.init, out_shardings=self.state_shardings.opt_state)(params)
            rng = jax.device_put(jax.random.key(self.c.init_weights_seed), self.state_shardings.rng)
            step = jax.device_put(jnp.int32(0), self.state_shardings.step)
            return TrainState(step=step, params=params, opt_state=opt_state, rng=rng)

    def jitted_step(self):
        fn = functools.partial(train_step, c=self.c, tx=self.tx)
        if self.device_state_shardings is not None:
            on_device, step_fn = self.device_state_shardings, fn

            def fn(state, batch):
                # Host-offloaded state is copied to device memory for the step; the outputs go
                # back to pinned host memory through out_shardings.
                return step_fn(jax.device_put(state, on_device), batch)

        return jax.jit(
            fn,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, None),
            donate_argnums=0,
        )

    def compile(self):
        with self.context():
            return self.jitted_step().lower(self.abstract_state(), self.abstract_batch()).compile()

    def put_batch(self, local: dict) -> dict:
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(local[k]))
            for k in BATCH_KEYS
        }


@contextlib.contextmanager
def _mesh_and_rules(mesh, rules):
    with jax.set_mesh(mesh), use_rules(rules):
        yield


def build_trainer(c: Config, devices=None) -> Trainer:
    """Mesh, rules, optimizer and shardings for `c`; raises ConfigError before any compilation."""
    mesh = make_mesh(c, devices)
    rules = config_rules(c)
    spec_tree = decoder.spec(c)
    tx = optimizer.make(c, spec_tree)
    param_sh = param.shardings(spec_tree, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = param.abstract(spec_tree, jnp.dtype(c.weight_dtype))
    opt_abstract = jax.eval_shape(tx.init, abstract)
    opt_sh = optax.tree_map_params(
        tx,
        lambda leaf, sh: leaf if isinstance(leaf, MaskedNode) else sh,
        opt_abstract,
        param_sh,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, MaskedNode),
    )
    state_sh = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated)
    batch_spec = logical_to_spec(("batch", "length"), rules, mesh)
    global_batch = int(c.per_device_batch_size * mesh.devices.size)
    host_sh = host_offloaded_shardings(c, state_sh, mesh)
    return Trainer(
        c,
        mesh,
        rules,
        tx,
        host_sh or state_sh,
        NamedSharding(mesh, batch_spec),
        global_batch,
        device_state_shardings=state_sh if host_sh is not None else None,
    )


def host_offloaded_shardings(c: Config, state_sh: TrainState, mesh) -> TrainState | None:
    """State shardings with parameters and/or optimizer state in pinned host memory.

    None when neither `parameter_memory_host_offload` nor `optimizer_memory_host_offload` is
    set; a ConfigError when one is set and the devices have no pinned host memory.
    """
    keys = [
        k
        for k in ("parameter_memory_host_offload", "optimizer_memory_host_offload")
        if getattr(c, k)
    ]
    if not keys:
        return None
    device = mesh.devices.flat[0]
    if not remat.backend_has_pinned_host([device]):
        raise ConfigError(
            f"{', '.join(f'{k}=true' for k in keys)}: the {device.platform} devices have no "
            "pinned_host memory to offload to; set it to false"
        )
    to_host = lambda tree: jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), tree)
    return dataclasses.replace(
        state_sh,
        params=to_host(state_sh.params) if c.parameter_memory_host_offload else state_sh.params,
        opt_state=(
            to_host(state_sh.opt_state) if c.optimizer_memory_host_offload else state_sh.opt_state
        ),
    )


# Keys that may differ between a run and its resumption: they change neither the model nor the data
# stream. The mesh may change (checkpoints reshard on restore); the global batch is checked against
# the checkpoint instead of per_device_batch_size; a resumed run ignores load_parameters_path (the
# checkpoint wins).
RESUMABLE_KEYS = frozenset(
    {
        "steps",
        "log_period",
        "base_output_directory",
        "run_name",
        "enable_checkpointing",
        "checkpoint_period",
        "max_checkpoints",
        "async_checkpointing",
        "skip_nonfinite_steps",
        "debug_inject_nan_step",
        "coordinator_address",
        "num_processes",
        "process_id",
        "data_worker_count",
        "per_device_batch_size",
        "sharding_rules",
        "remat_policy",
        *remat.ALL_NAMES,  # per-name placements: same numbers, other memory
        "use_iota_embed",
        "scan_layers",
        "load_parameters_path",
        # layout and kernel choices: the same model and numbers (the parity table proves it)
        "use_ring_of_experts",
        "a2a_impl",
        "shard_exp_on_fsdp",
        "gmm_impl",
        "gmm_tile_rows",
        "gmm_tile_rows_min",
        "optimizer_memory_host_offload",
        "parameter_memory_host_offload",
        *(
            f"{p}_{a}_parallelism"
            for p in ("ici", "dcn")
            for a in ("pipeline", "data", "fsdp", "expert", "tensor")
        ),
    }
)


def _barrier(name: str) -> None:
    """All processes reach this point before any goes on (no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _resolve_run_name(c: Config) -> str:
    if c.run_name:
        return c.run_name
    stamp = int(time.time())
    if jax.process_count() > 1:  # process 0's clock names the run for every process
        stamp = int(multihost_utils.broadcast_one_to_all(np.int32(stamp)))
    return datetime.fromtimestamp(stamp).strftime("%Y%m%d-%H%M%S")


def _check_resumable(c: Config, run_dir: Path, step: int | None, has_metrics: bool) -> None:
    """A folder with metrics needs a checkpoint; a resume, the same model and data keys."""
    if step is None and has_metrics:
        raise ConfigError(
            f"run_name={c.run_name!r}: {run_dir} already holds a run (metrics.jsonl) but no "
            "complete checkpoint; choose another run_name or remove that folder yourself"
        )
    if step is not None:
        _check_same_run(c, run_dir, step)


def _check_same_run(c: Config, run_dir: Path, step: int) -> None:
    """Refuse to resume with keys that change the model or the data (RESUMABLE_KEYS may differ)."""
    path = run_dir / "config.yml"
    if not path.exists():
        return
    saved = yaml.safe_load(path.read_text()) or {}
    diffs = []
    for key, field in Config.model_fields.items():
        if key in RESUMABLE_KEYS:
            continue
        old, new = saved.get(key, field.default), getattr(c, key)
        if old != new:
            diffs.append(f"{key}: {old!r} -> {new!r}")
    if diffs:
        raise ConfigError(
            f"run_name={c.run_name!r}: {run_dir} holds a run (checkpoint of step {step}) saved "
            "with different values of keys that change the model or the data "
            f"({'; '.join(diffs)}); "
            "resume with the saved values (config.yml there) or choose another run_name"
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


def _mark_checkpoint_dir(ckpt_dir: Path) -> None:
    """Process 0 creates the checkpoint directory and its marker before any process opens it, so no
    process sees a half-written marker (Checkpointer checks the directory on every process)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    marker = ckpt_dir / checkpoint.MARKER_FILE
    if not marker.exists() and not any(True for _ in ckpt_dir.iterdir()):
        tmp = ckpt_dir / f".{checkpoint.MARKER_FILE}.tmp"
        content = {"format": checkpoint.FORMAT, "version": checkpoint.FORMAT_VERSION}
        tmp.write_text(json.dumps(content))
        tmp.rename(marker)


@dataclasses.dataclass
class RunDir:
    """A prepared run folder: where it is, its checkpoints (None: off) and the step to resume."""

    path: Path
    checkpointer: checkpoint.Checkpointer | None
    resume_step: int | None


def prepare_run_dir(c: Config) -> tuple[Config, RunDir]:
    """Resolve run_name and create or reopen the run folder.

    A folder whose checkpoints hold a complete step is resumed from its latest one (the records of
    later steps are removed from metrics.jsonl); a folder with metrics.jsonl but no checkpoint is
    refused, never overwritten. Every process calls this; process 0 writes.
    """
    run_name = _resolve_run_name(c)
    c = c.model_copy(update={"run_name": run_name})
    run_dir = Path(c.base_output_directory) / run_name
    ckpt_dir = run_dir / params_io.CHECKPOINT_SUBDIR
    has_metrics = (run_dir / "metrics.jsonl").exists()
    has_checkpoints = ckpt_dir.exists()
    if has_metrics and not has_checkpoints:
        raise ConfigError(
            f"run_name={run_name!r}: {run_dir} already holds a run (metrics.jsonl) without "
            "checkpoints to resume from; choose another run_name or remove that folder yourself"
        )
    _barrier("expertax:inspected-run-dir")  # everyone looked before process 0 writes
    ckpt = None
    if c.enable_checkpointing or has_checkpoints:
        if jax.process_index() == 0:
            _mark_checkpoint_dir(ckpt_dir)
        _barrier("expertax:checkpoint-dir")
        try:
            ckpt = checkpoint.Checkpointer(
                ckpt_dir,
                period_steps=c.checkpoint_period,
                max_to_keep=c.max_checkpoints,
                enable_async=c.async_checkpointing,
            )
        except ValueError as e:
            raise ConfigError(f"run_name={run_name!r}: {e}") from None
    try:
        resume = ckpt.latest_step() if ckpt is not None else None
        _check_resumable(c, run_dir, resume, has_metrics)
        if resume is None and c.load_parameters_path:
            params_io.check_model_dir(c)  # before the run folder is written or anything compiled
    except ConfigError:
        if ckpt is not None:
            ckpt.close()
        raise
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yml").write_text(config_to_yaml(c))
        if resume is not None:
            _trim_metrics(run_dir / "metrics.jsonl", resume)
    _barrier("expertax:run-dir-ready")
    return c, RunDir(run_dir, ckpt, resume)


def check_tokenizer_vocab(c: Config) -> None:
    """The tokenizer's ids must fit the embedding: its vocabulary size <= vocab_size."""
    try:
        tok = tokenizer.load_tokenizer(c.tokenizer_path)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > c.vocab_size:
        raise ConfigError(
            f"tokenizer_path={c.tokenizer_path!r} has {n} tokens but vocab_size={c.vocab_size}; "
            f"set vocab_size={n} or more (the model must embed every token id)"
        )


def make_data(c: Config, trainer: Trainer):
    """This process's batch iterator: rows global_batch / process_count, its share of the batch."""
    count, index = jax.process_count(), jax.process_index()
    if trainer.global_batch % count:
        raise ConfigError(
            f"the global batch {trainer.global_batch} (per_device_batch_size="
            f"{c.per_device_batch_size}) does not split evenly over {count} processes"
        )
    rows = trainer.global_batch // count
    if c.dataset_type == "files":
        try:
            return files.make_file_iterator(
                dataset_path=c.dataset_path,
                tokenizer_path=c.tokenizer_path,
                text_field=c.data_text_field,
                seq_len=c.max_target_length,
                batch_size=rows,
                seed=c.data_shuffle_seed,
                process_index=index,
                process_count=count,
                num_epochs=None if c.data_num_epochs == -1 else c.data_num_epochs,
                worker_count=c.data_worker_count,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return SyntheticData(
        vocab_size=c.vocab_size,
        seq_len=c.max_target_length,
        global_batch=trainer.global_batch,
        seed=c.data_shuffle_seed,
        row_start=rows * index,
        rows=rows,
    )


def _allgather_json(obj) -> list:
    """Every process's JSON-serialisable `obj`, in process order (a collective: all must call)."""
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(raw.size))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(bytes(r[:n]).decode()) for r, n in zip(rows, lengths)]


def data_checkpoint_state(c: Config, trainer: Trainer, data, skipped_steps: int) -> dict:
    """The JSON item saved with each checkpoint: the data position(s) and loop counters.

    Synthetic data is a function of the step, the same on every process; a file iterator's
    position differs per process (each reads its own documents), so all positions are gathered.
    """
    it_state = data.get_state()
    if c.dataset_type == "files" and jax.process_count() > 1:
        iterators = _allgather_json(it_state)
    else:
        iterators = [it_state]
    return {
        "dataset_type": c.dataset_type,
        "global_batch": trainer.global_batch,
        "skipped_steps": skipped_steps,
        "iterators": iterators,
    }


def restore_checkpoint(c: Config, trainer: Trainer, run: RunDir, data) -> tuple[TrainState, int]:
    """The train state of run.resume_step (resharded onto trainer's mesh); positions `data`.

    Returns the state and the count of skipped (non-finite) steps so far.
    """
    step = run.resume_step
    state, saved = run.checkpointer.restore(step, trainer.abstract_state())
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


def train(c: Config, *, echo=print, devices=None, stop_after_step: int | None = None) -> dict:
    """Train `c` and return a summary dict; writes metrics.jsonl and config.yml in the run dir.

    Re-running the same config (same run_name) resumes from the latest complete checkpoint.
    `devices`: the devices of the mesh (default: all). `stop_after_step`: end after this many steps
    of the run in all, with a checkpoint, as a preemption would; the run stays resumable.
    """
    trainer = build_trainer(c, devices)
    if c.dataset_type == "files":
        check_tokenizer_vocab(c)
    c, run = prepare_run_dir(c)
    run_dir = run.path
    writer = metrics_lib.MetricsWriter(run_dir if jax.process_index() == 0 else None)
    say = echo if jax.process_index() == 0 else (lambda *_: None)
    say(
        f"expertax: {c.model_name} on {trainer.num_devices} {jax.default_backend()} devices, "
        f"mesh {dict(trainer.mesh.shape)}, global batch {trainer.global_batch} x "
        f"{c.max_target_length}, run dir {run_dir}"
    )
    try:
        return _run(c, trainer, run, writer, say, stop_after_step)
    finally:
        if run.checkpointer is not None:
            run.checkpointer.close()  # waits for the last save


def _initial_state(c: Config, trainer: Trainer, say) -> TrainState:
    """Step 0: random parameters, or those of load_parameters_path; a fresh optimizer state."""
    if not c.load_parameters_path:
        return trainer.init_state()
    abstract = trainer.abstract_state().params
    params = params_io.load_params(c, trainer.state_shardings.params, abstract)
    say(f"loaded the parameters of {c.load_parameters_path} (fresh optimizer state, step 0)")
    return trainer.init_state(params)


def _run(c: Config, trainer: Trainer, run: RunDir, writer, say, stop_after_step) -> dict:
    t0 = time.perf_counter()
    data = make_data(c, trainer)
    if run.resume_step is None:
        state, skipped, start = _initial_state(c, trainer, say), 0, 0
    else:
        state, skipped = restore_checkpoint(c, trainer, run, data)
        start = run.resume_step
        say(f"resumed from the checkpoint of step {start} in {run.checkpointer.directory}")
        if c.load_parameters_path:
            say(f"load_parameters_path={c.load_parameters_path!r} ignored: the checkpoint wins")
    step_fn = trainer.compile()
    say(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    say(describe_dispatch(c, dict(trainer.mesh.shape)))
    end = c.steps if stop_after_step is None else min(c.steps, stop_after_step)
    saving = run.checkpointer is not None and c.enable_checkpointing
    flops = metrics_lib.train_flops_per_token(c)
    tokens = trainer.global_batch * c.max_target_length
    records: list[dict] = []

    def emit(step: int, device_metrics, t_prev: float) -> float:
        nonlocal skipped
        host = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        now = time.perf_counter()
        dt = now - t_prev
        rec = {"step": step, **host}
        rec["perplexity"] = metrics_lib.perplexity(host["loss"])
        rec["step_time_s"] = dt
        rec["tokens_per_s_per_device"] = tokens / dt / trainer.num_devices
        rec["tflops_per_device"] = flops * tokens / dt / trainer.num_devices / 1e12
        if host["nonfinite"] and c.skip_nonfinite_steps:
            skipped += 1
        rec["skipped_steps"] = skipped
        records.append(rec)
        writer.write(rec)
        if host["nonfinite"]:
            _nonfinite(c, step, host, skipped, say)
        if step % c.log_period == 0 or step == c.steps - 1:
            say(metrics_lib.console_line(rec))
        return now

    pending = None
    t_prev = time.perf_counter()
    saved = done = start

    def save(force: bool) -> None:
        nonlocal pending, t_prev, saved
        if not saving or saved == done or not run.checkpointer.should_save(done, force=force):
            return
        if pending is not None:  # a non-finite step must stop the run before it is saved
            t_prev, pending = emit(*pending, t_prev), None
        ds = data_checkpoint_state(c, trainer, data, skipped)
        run.checkpointer.maybe_save(done, state, ds, force=force)
        saved = done

    with trainer.context():
        for step in range(start, end):
            try:
                local = next(data)
            except StopIteration:
                say(f"data exhausted (data_num_epochs={c.data_num_epochs}) before step {step}")
                break
            state, m = step_fn(state, trainer.put_batch(local))
            done = step + 1
            if pending is not None:
                t_prev = emit(*pending, t_prev)
            pending = (step, m)
            save(force=done == end)
        save(force=True)  # the last step, also when the data ran out
        if pending is not None:
            emit(*pending, t_prev)
    return _summary(c, trainer, run, records, state, data, skipped, say)


def _nonfinite(c: Config, step: int, host: dict, skipped: int, say) -> None:
    what = (
        f"loss {host['loss']}, load-balance loss {host['lb_loss']}, grad norm {host['grad_norm']}"
    )
    if not c.skip_nonfinite_steps:
        raise NonFiniteError(
            f"step {step}: non-finite {what}; the update was not applied and the run stops (the "
            "checkpoints hold finite states only). Set skip_nonfinite_steps=true to skip such "
            "updates instead, or lower learning_rate"
        )
    say(f"step {step}: non-finite {what}; update skipped ({skipped} skipped so far)")


def _summary(c, trainer, run, records, state, data, skipped, say) -> dict:
    tokens = trainer.global_batch * c.max_target_length
    summary = {
        "run_dir": str(run.path),
        "steps": c.steps,
        "resumed_from": run.resume_step,
        "skipped_steps": skipped,
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
        tokens_per_s_per_device=tokens / median / trainer.num_devices,
    )
    say(
        f"done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, median step "
        f"{median:.3f} s, {summary['tokens_per_s_per_device']:.0f} tokens/s/device"
        + (f", {skipped} non-finite steps skipped" if skipped else "")
    )
    return summary
