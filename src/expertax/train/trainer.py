"""The Trainer: mesh, rules, optimizer and the shardings of the train state, and the jitted step.

`build_trainer` raises ConfigError (mesh sizes, rules, offload requests) before anything is
compiled or written; `Trainer.compile` compiles the step abstractly (AOT), which is what
`expertax memory` and `expertax parity` use as well as the train loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from expertax import platform, preflight
from expertax.config import config_rules
from expertax.config.schema import Config
from expertax.errors import ConfigError
from expertax.fp8 import kernel as fp8_kernel
from expertax.models import decoder, init_params
from expertax.nn import param
from expertax.nn.moe import strategy
from expertax.parallel import remat
from expertax.sharding import logical_to_spec, make_mesh, use_rules
from expertax.sharding.mesh import check_context_rules
from expertax.train import optimizer
from expertax.train.state import TrainState
from expertax.train.step import train_step

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


def batch_keys(c: Config) -> tuple[str, ...]:
    """The batch's fields: BATCH_KEYS ([B, T] each), then `advantages` (float32 [B, T]) under
    `token_advantages` and `routing` (int32 [B, T, L_moe, K]) under `routing_replay`."""
    return (
        BATCH_KEYS
        + (("advantages",) if c.token_advantages else ())
        + (("routing",) if c.routing_replay else ())
    )


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
    # Under an fp8 `quantization`: the routed experts' fp8 backend and why (fp8/kernel.py)
    fp8_experts: str = ""

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    def context(self):
        """Mesh and rules active while tracing."""
        return _mesh_and_rules(self.mesh, self.rules)

    def abstract_batch(self) -> dict:
        c = self.c
        shape = (self.global_batch, c.max_target_length)
        dt = {"weights": jnp.float32, "advantages": jnp.float32}
        extra = {"routing": (c.num_moe_layers, c.num_experts_per_tok)}
        return {
            k: jax.ShapeDtypeStruct(
                shape + extra.get(k, ()), dt.get(k, jnp.int32), sharding=self.batch_sharding
            )
            for k in batch_keys(c)
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
            on_device, c = self.device_state_shardings, self.c
            if c.optimizer_memory_host_offload:
                fn = functools.partial(
                    fn, opt_to_device=lambda o: jax.device_put(o, on_device.opt_state)
                )
            step_fn = fn

            def fn(state, batch):
                # Host-offloaded parameters are copied to device memory for the step, the
                # optimizer state (train_step's `opt_to_device`) only for the update; the
                # outputs go back to pinned host memory through out_shardings. Only the
                # offloaded trees move: a device_put of the whole state would also constrain
                # the PRNG key, whose key-typed scalar the TPU partitioner refuses a sharding for.
                if c.parameter_memory_host_offload:
                    params = jax.device_put(state.params, on_device.params)
                    state = dataclasses.replace(state, params=params)
                return step_fn(state, batch)

        return jax.jit(
            fn,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, None),
            donate_argnums=0,
            compiler_options=self.compiler_options(),
        )

    def compiler_options(self) -> dict | None:
        """XLA options of the step: a GPU program of fp8 GEMMs with XLA's Triton GEMMs off,
        so that cuBLASLt's fp8 rewrite sees the dots (fp8/matmul.py)."""
        if self.c.quantization and platform.of_mesh(self.mesh) == "gpu":
            return dict(fp8_kernel.GPU_COMPILER_OPTIONS)
        return None

    def compile(self):
        with self.context():
            return self.jitted_step().lower(self.abstract_state(), self.abstract_batch()).compile()

    def put_batch(self, local: dict) -> dict:
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(local[k]))
            for k in batch_keys(self.c)
        }


@contextlib.contextmanager
def _mesh_and_rules(mesh, rules):
    on = platform.use(platform.of_mesh(mesh), mesh.devices.flat[0])
    with jax.set_mesh(mesh), use_rules(rules), on:
        yield


def build_trainer(c: Config, devices=None) -> Trainer:
    """Mesh, rules, optimizer and shardings for `c`; raises ConfigError before any compilation."""
    mesh = make_mesh(c, devices)
    preflight.check(c, mesh)  # the platform's kernels, the remat names, the layout
    rules = config_rules(c)
    check_context_rules(c, dict(mesh.shape), rules)
    fp8_experts = ""
    if c.is_moe and c.sparse_matmul:
        specs = strategy.moe_specs(rules)  # a rules table the MoE layer cannot compute: ConfigError
        if c.quantization:  # gmm_impl=fp8_hopper where its kernel cannot run: ConfigError
            f_local = c.base_moe_mlp_dim // math.prod(mesh.shape[a] for a in specs.mlp)
            on, device = platform.of_mesh(mesh), mesh.devices.flat[0]
            fp8_experts = fp8_kernel.routed_choice(
                c.gmm_impl, c.quantization, on, device, c.base_emb_dim, f_local
            )[1]
    spec_tree = decoder.spec(c)
    tx = optimizer.make(c, spec_tree)
    param_sh = param.shardings(spec_tree, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = param.abstract(spec_tree, jnp.dtype(c.weight_dtype))
    opt_abstract = jax.eval_shape(tx.init, abstract)
    opt_sh = optax.tree_map_params(
        tx,
        lambda leaf, sh: leaf if isinstance(leaf, optax.MaskedNode) else sh,
        opt_abstract,
        param_sh,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )
    state_sh = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated)
    batch_spec = logical_to_spec(("batch", "length"), rules, mesh)
    global_batch = int(c.per_device_batch_size * mesh.devices.size)
    check_pipeline_batch(c, global_batch, _spec_size(batch_spec, mesh))
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
        fp8_experts=fp8_experts,
    )


def _spec_size(spec: PartitionSpec, mesh, *, skip=("pipeline",)) -> int:
    """Shards of a PartitionSpec's first dimension over the mesh axes other than `skip` (inside
    the pipeline the batch is not split over `pipeline`, which holds the stages)."""
    first = spec[0] if len(spec) else None
    names = () if first is None else (first,) if isinstance(first, str) else first
    return math.prod(mesh.shape[n] for n in names if n not in skip)


def check_pipeline_batch(c: Config, global_batch: int, batch_shards: int) -> None:
    """With pipeline stages, the global batch must split into whole microbatches, each of which
    still splits over the batch shards inside a stage (data x fsdp x expert under the default
    rules)."""
    m = c.pipeline_microbatches
    if c.pipeline_stages == 1:
        return
    key = f"num_pipeline_microbatches={c.num_pipeline_microbatches}"
    batch = f"{global_batch} sequences (per_device_batch_size={c.per_device_batch_size} x devices)"
    if global_batch % m:
        raise ConfigError(
            f"{key}: the global batch of {batch} does not split into {m} microbatches; use a "
            f"divisor of {global_batch}"
        )
    if (global_batch // m) % batch_shards:
        valid = [k for k in range(1, global_batch + 1) if global_batch % (k * batch_shards) == 0]
        raise ConfigError(
            f"{key}: microbatches of {global_batch // m} sequences (global batch: {batch}) do "
            f"not split over the {batch_shards} batch shards; use one of {valid} or a larger batch"
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
    devices = list(mesh.devices.flat)
    if not remat.backend_has_pinned_host(devices):
        raise ConfigError(
            f"{', '.join(f'{k}=true' for k in keys)}: the {platform.of_devices(devices)} devices "
            "have no "
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
