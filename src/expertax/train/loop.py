"""Build the sharded, compiled train step and run the training loop.

Metrics are fetched one step late: step i+1 is dispatched before step i's metrics are read, so
the host never stalls the device. `step_time_s` is the time between consecutive fetches.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from datetime import datetime
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.transforms._masking import MaskedNode
from jax.sharding import NamedSharding, PartitionSpec

from expertax.config.checks import ConfigError
from expertax.config.loader import config_to_yaml
from expertax.config.schema import Config
from expertax.data.synthetic import SyntheticData
from expertax.models import decoder, init_params
from expertax.nn import param
from expertax.parallel import remat
from expertax.sharding import load_rules, logical_to_spec, make_mesh, use_rules
from expertax.train import metrics as metrics_lib
from expertax.train import optimizer
from expertax.train.state import TrainState
from expertax.train.step import train_step

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
        stack = _ContextStack(jax.set_mesh(self.mesh), use_rules(self.rules))
        return stack

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

    def init_state(self) -> TrainState:
        with self.context():
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


class _ContextStack:
    def __init__(self, *managers):
        self.managers = managers

    def __enter__(self):
        for m in self.managers:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self.managers):
            m.__exit__(*exc)
        return False


def build_trainer(c: Config, devices=None) -> Trainer:
    """Mesh, rules, optimizer and shardings for `c`; raises ConfigError before any compilation."""
    mesh = make_mesh(c, devices)
    rules = load_rules(c.sharding_rules)
    spec_tree = decoder.spec(c)
    tx = optimizer.make(c, param.trainable_mask(spec_tree))
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
        c, mesh, rules, tx, host_sh or state_sh, NamedSharding(mesh, batch_spec), global_batch,
        device_state_shardings=state_sh if host_sh is not None else None,
    )


def host_offloaded_shardings(c: Config, state_sh: TrainState, mesh) -> TrainState | None:
    """State shardings with parameters and/or optimizer state in pinned host memory.

    None when neither `parameter_memory_host_offload` nor `optimizer_memory_host_offload` is
    set; a ConfigError when one is set and the devices have no pinned host memory.
    """
    keys = [k for k in ("parameter_memory_host_offload", "optimizer_memory_host_offload")
            if getattr(c, k)]
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


def prepare_run_dir(c: Config) -> tuple[Config, Path]:
    """Resolve run_name and create the run folder; never reuses a folder that holds a run."""
    run_name = c.run_name or datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(c.base_output_directory) / run_name
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(
            f"run_name={run_name!r}: {run_dir} already holds a run (metrics.jsonl); choose another "
            "run_name or remove that folder yourself"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    c = c.model_copy(update={"run_name": run_name})
    (run_dir / "config.yml").write_text(config_to_yaml(c))
    return c, run_dir


def make_data(c: Config, trainer: Trainer):
    rows = trainer.global_batch // jax.process_count()
    return SyntheticData(
        vocab_size=c.vocab_size,
        seq_len=c.max_target_length,
        global_batch=trainer.global_batch,
        seed=c.data_shuffle_seed,
        row_start=rows * jax.process_index(),
        rows=rows,
    )


def train(c: Config, *, echo=print) -> dict:
    """Train `c` and return a summary dict; writes metrics.jsonl and config.yml in the run dir."""
    trainer = build_trainer(c)
    c, run_dir = prepare_run_dir(c)
    writer = metrics_lib.MetricsWriter(run_dir if jax.process_index() == 0 else None)
    say = echo if jax.process_index() == 0 else (lambda *_: None)
    say(
        f"expertax: {c.model_name} on {trainer.num_devices} {jax.default_backend()} devices, "
        f"mesh {dict(trainer.mesh.shape)}, global batch {trainer.global_batch} x "
        f"{c.max_target_length}, run dir {run_dir}"
    )
    t0 = time.perf_counter()
    state = trainer.init_state()
    step_fn = trainer.compile()
    say(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    data = make_data(c, trainer)
    flops = metrics_lib.train_flops_per_token(c)
    tokens = trainer.global_batch * c.max_target_length
    records: list[dict] = []

    def emit(step: int, device_metrics, t_prev: float) -> float:
        host = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        now = time.perf_counter()
        dt = now - t_prev
        rec = {"step": step, **host}
        rec["perplexity"] = metrics_lib.perplexity(host["loss"])
        rec["step_time_s"] = dt
        rec["tokens_per_s_per_device"] = tokens / dt / trainer.num_devices
        rec["tflops_per_device"] = flops * tokens / dt / trainer.num_devices / 1e12
        records.append(rec)
        writer.write(rec)
        if step % c.log_period == 0 or step == c.steps - 1:
            say(metrics_lib.console_line(rec))
        return now

    pending = None
    t_prev = time.perf_counter()
    with trainer.context():
        for step in range(c.steps):
            batch = trainer.put_batch(next(data))
            state, m = step_fn(state, batch)
            if pending is not None:
                t_prev = emit(*pending, t_prev)
            pending = (step, m)
        emit(*pending, t_prev)
    steady = [r["step_time_s"] for r in records[2:]] or [r["step_time_s"] for r in records]
    median = statistics.median(steady)
    summary = {
        "run_dir": str(run_dir),
        "steps": c.steps,
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "final_perplexity": records[-1]["perplexity"],
        "median_step_time_s": median,
        "tokens_per_s_per_device": tokens / median / trainer.num_devices,
        "devices": trainer.num_devices,
    }
    say(
        f"done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, median step "
        f"{median:.3f} s, {summary['tokens_per_s_per_device']:.0f} tokens/s/device"
    )
    summary["state"] = state
    return summary
