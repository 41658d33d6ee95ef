"""Test settings: 8 simulated CPU devices, strict numerics. Set before JAX is imported.

The tests' programs are tiny and compiled far more than they run, so XLA:CPU's LLVM backend
optimisation is off (`--xla_backend_optimization_level=0`, about a fifth less CPU time over the
suite). The HLO programs, their fusions and buffer assignments (what the planner and the program
checks read) are the ones a user's run compiles; only the machine code is less optimised. The
tolerances are the same at both levels (the suite passes at both). tests/xla_flags.py has the
flags, and the cheaper code generation that children of tolerance-only tests use."""

import os

from tests.xla_flags import with_devices

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + with_devices(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compile-only TPU targets load libtpu in several test processes at once (see expertax.targets).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

# The fp8 Hopper kernels' numerics are tested in Pallas's Mosaic GPU interpreter, whose
# parameters jax 0.10.2 exports from no public module: the tests (not the library) import it.
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

from expertax.nn.moe import fp8_hopper  # noqa: E402

fp8_hopper.INTERPRETER = InterpretGPUParams()

# A shrunk Mixtral with DeepSeek's sigmoid routing and balancing bias (a parameter updated outside
# the optimizer), shared by the trainer-level tests so they reuse one compiled step.
TINY_MOE = dict(
    model_name="mixtral-tiny",
    base_emb_dim=64,
    base_moe_mlp_dim=64,
    vocab_size=128,
    base_num_decoder_layers=1,
    num_experts=4,
    routed_score_func="sigmoid",
    routed_bias=True,
    max_target_length=32,
    per_device_batch_size=1,
    log_period=100,
)


@pytest.fixture(scope="module")
def persistent_compile_cache(tmp_path_factory):
    """One persistent compilation cache for the session's train() runs (shared across modules):
    trainer-level tests that build the same step compile it once."""
    path = tmp_path_factory.getbasetemp() / "jax-compilation-cache"
    settings = {
        "jax_compilation_cache_dir": str(path),
        "jax_persistent_cache_min_compile_time_secs": 0,
    }
    saved = {k: getattr(jax.config, k) for k in settings}
    for k, v in settings.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()
    yield
    for k, v in saved.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()
