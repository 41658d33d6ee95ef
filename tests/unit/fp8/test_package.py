"""The fp8 package's import boundary: the layers import the fp8 matmuls, never the Hopper kernels'
Pallas Mosaic GPU, which only a product assigned to them imports."""

import subprocess
import sys

MOSAIC = ("jax.experimental.mosaic", "jax._src.pallas.mosaic_gpu", "expertax.fp8.hopper.gmm")


def _loaded_after(module: str) -> list[str]:
    code = (
        f"import sys, {module}\n"
        f"print('\\n'.join(m for m in sys.modules if m.startswith({MOSAIC!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return out.stdout.split()


def test_the_layers_do_not_import_mosaic_gpu():
    for module in ("expertax.nn.linear", "expertax.nn.moe.dispatch", "expertax.fp8.kernel"):
        assert _loaded_after(module) == [], module


def test_the_hopper_kernels_import_mosaic_gpu():
    # the negative control: the check above sees Mosaic GPU where it is imported
    assert "jax._src.pallas.mosaic_gpu" in _loaded_after("expertax.fp8.hopper.gmm")
