"""The XLA flags of the test processes (tests/conftest.py says why). Child processes that set
XLA_FLAGS themselves add them too.

`CHEAP_CPU_CODEGEN` (every test process but the children of test_parity_deep.py, which need
XLA:CPU's default code: `with_devices(n, codegen="")`): LLVM's optimisation off. The HLO
programs, their fusions and buffer assignments are a user's; only the machine code is less
optimised.

`TOLERANCE_ONLY_CODEGEN` (children of tests that compare losses within a tolerance, such as the
whole parity matrix, and the odd-numbered xdist workers of the default run, which take only the
files measured to pass with it: tests/timing.py): XLA:CPU's fusions emitted by its direct LLVM
IR emitters instead of its MLIR fusion pipeline, a train step of the tiny models compiled in
about 0.6 x the time. It changes the fusions and the rounding of some of them, so the tests that
compare programs bitwise (remat policies, the stash) or read the compiled program do not run
with it.
"""

CHEAP_CPU_CODEGEN = "--xla_backend_optimization_level=0"
TOLERANCE_ONLY_CODEGEN = f"{CHEAP_CPU_CODEGEN} --xla_cpu_use_fusion_emitters=false"


def with_devices(n: int, codegen: str = CHEAP_CPU_CODEGEN) -> str:
    """XLA_FLAGS for a test process with `n` simulated CPU devices."""
    return f"--xla_force_host_platform_device_count={n} {codegen}".strip()
