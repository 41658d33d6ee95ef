"""Test settings: 8 simulated CPU devices, strict numerics. Set before JAX is imported.

The tests' programs are tiny and compiled far more than they run, so XLA:CPU's LLVM backend
optimisation is off (`--xla_backend_optimization_level=0`, about a fifth less CPU time over the
suite). The HLO programs, their fusions and buffer assignments (what the planner and the program
checks read) are the ones a user's run compiles; only the machine code is less optimised. The
tolerances are the same at both levels (the suite passes at both). tests/xla_flags.py has the
flags, and the cheaper code generation that children of tolerance-only tests use."""

import os
import shutil
import tempfile

from tests.timing import worker_codegen
from tests.xla_flags import CHEAP_CPU_CODEGEN, TOLERANCE_ONLY_CODEGEN, with_devices

# The worker's code generation (tests/timing.py: in the default run, gw0 compiles with the
# default and takes the tests marked `default_codegen`; the other workers take the rest, with the
# tolerance-only one)
_CODEGEN = {"default": CHEAP_CPU_CODEGEN, "cheap": TOLERANCE_ONLY_CODEGEN}[
    worker_codegen(
        os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    )
]
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " " + with_devices(8, codegen=_CODEGEN)
).strip()
# One persistent compilation cache for the whole run: this process, its xdist workers and every
# child a test starts inherit the folder, so a program compiled once (a one-device reference, a
# trainer's step, a child's layout) is read back by every later test that builds it. A folder
# the caller names (CI's `.ci/run`) is used as it is; otherwise the first process makes one
# for this run and removes it at the end.
_OWN_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _OWN_CACHE = tempfile.mkdtemp(prefix="expertax-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
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

from expertax.fp8 import kernel as fp8_kernel  # noqa: E402
from tests import timing  # noqa: E402  (its schedule and durations report)

fp8_kernel.INTERPRETER = InterpretGPUParams()

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


def pytest_configure(config):
    config.pluginmanager.register(timing, "expertax-timing")  # tests/timing.py


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # pytest-xdist's hook
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker more than the cores in the default run (tests/timing.py)."""
    return timing.auto_workers(config)


def pytest_unconfigure(config):
    if _OWN_CACHE is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(scope="module")
def persistent_compile_cache():
    """The run's compilation cache (above) for every program of a module's train() runs, the
    fast ones too: trainer-level tests that build the same step compile it once."""
    settings = {"jax_persistent_cache_min_compile_time_secs": 0}
    saved = {k: getattr(jax.config, k) for k in settings}
    for k, v in settings.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()
    yield
    for k, v in saved.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


ON_DEMAND = ("full_grid", "compile_matrix", "full_matrix")


def pytest_collection_finish(session):
    """With `EXPERTAX_COLLECTION_OUT=PATH`: every collected test's markers and `covered_by`
    nodeids as JSON (tests/unit/test_on_demand.py reads it)."""
    out = os.environ.get("EXPERTAX_COLLECTION_OUT")
    if not out or hasattr(session.config, "workerinput"):
        return
    import json

    rows = {
        item.nodeid: {
            "markers": sorted({m.name for m in item.iter_markers()}),
            "covered_by": [n for m in item.iter_markers("covered_by") for n in m.args],
        }
        for item in session.items
    }
    with open(out, "w") as f:
        json.dump(rows, f)
