"""TensorBoard event files of a run, in <run dir>/tensorboard, written by process 0 (tensorboardX).

What is written (metrics.jsonl stays the source of truth; this is a view of it):
    <key>                                every numeric scalar of a metrics.jsonl record, every step
                                         (loss, learning_rate, grad_norm, eval_loss, ...)
    device_memory/bytes_in_use_gib       device 0 of this process, at log_period, where the
    device_memory/peak_bytes_in_use_gib  backend reports it (memory_stats() is None on CPU)
    expert_load/layer_<i>                histogram over expert ids: bucket e holds the
                                         (token, expert) assignments of expert e at that step
    expert_load_max_over_mean/layer_<i>  max / mean load of MoE layer i
    experts_without_tokens/layer_<i>     experts of layer i that received nothing
    config (text)                        the resolved config.yml

A value that is not finite (the loss of a step whose update was skipped, say) is left out of the
event files: tensorboardX would log a warning for each, and TensorBoard's plots cannot show it.
The first one is named once on stderr; metrics.jsonl keeps every one (as null).

The summaries are built and written on one background thread (in call order): building a
tensorboardX scalar costs ~30 us of Python, ~0.4 ms for a record's ~14 scalars, which the train
loop's thread should not pay between dispatching steps. `close()` waits for them and re-raises
the first error of the thread.
"""

from __future__ import annotations

import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from expertax.train import metrics as metrics_lib

TENSORBOARD_SUBDIR = "tensorboard"
GIB = 2**30


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch.

    tensorboardX's writer module imports torch when it can (only to accept torch tensors); that
    costs about a second and a large import in a JAX process. A None entry in sys.modules makes
    that optional import fail fast; it is removed again right after, so torch stays importable.
    """
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        if blocked:
            del sys.modules["torch"]
    return SummaryWriter


class TensorBoardWriter:
    """Event files for one run; `path` None (not process 0, or enable_tensorboard=false): off."""

    def __init__(self, path: Path | None, config_yaml: str = ""):
        self.writer = None
        self.error: BaseException | None = None
        self.left_out = 0  # non-finite values not written (the first one named on stderr)
        if path is None:
            return
        self.writer = _summary_writer_class()(logdir=str(path / TENSORBOARD_SUBDIR), flush_secs=30)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="expertax-tensorboard")
        if config_yaml:  # indented: a code block in TensorBoard's markdown text view
            text = "\n".join("    " + line for line in config_yaml.splitlines())
            self.writer.add_text("config", text, 0)

    def _later(self, fn, *args) -> None:
        """Run fn(*args) on the writer thread; keep its first error for close()."""

        def run():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised by close()
                self.error = self.error or e

        self.thread.submit(run)

    def scalars(self, record: dict) -> None:
        """Every numeric value of a metrics.jsonl record, under its own key."""
        if self.writer is not None:
            self._later(self._scalars, dict(record))

    def expert_loads(self, step: int, load_LE) -> None:
        """Per MoE layer: the load histogram over expert ids, max/mean, experts with nothing."""
        if self.writer is not None:
            self._later(self._expert_loads, step, np.array(load_LE, np.float64))

    def device_memory(self, step: int, stats: dict | None) -> None:
        """bytes_in_use / peak_bytes_in_use of a device's memory_stats() (skipped when None)."""
        if self.writer is not None and stats:
            self._later(self._device_memory, step, dict(stats))

    def close(self) -> None:
        """Write what is queued, close the files; raise the writer thread's first error."""
        if self.writer is not None:
            self.thread.shutdown(wait=True)
            self.writer.close()
            self.writer = None
        if self.error is not None:
            raise self.error

    def _scalars(self, record: dict) -> None:
        assert self.writer is not None
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self._scalar(key, value, step)

    def _expert_loads(self, step: int, load_LE: np.ndarray) -> None:
        assert self.writer is not None
        experts = load_LE.shape[-1]
        limits = np.arange(1, experts + 1, dtype=np.float64)  # right edges: bucket e = [e, e+1)
        ids_E = np.arange(experts, dtype=np.float64)
        for i, load_E in enumerate(load_LE):
            summary = metrics_lib.expert_load_summary(load_E)
            self.writer.add_histogram_raw(
                f"expert_load/layer_{i}",
                min=0.0,
                max=float(experts),
                num=float(load_E.sum()),
                sum=float((ids_E * load_E).sum()),
                sum_squares=float((ids_E**2 * load_E).sum()),
                bucket_limits=limits.tolist(),
                bucket_counts=load_E.tolist(),
                global_step=step,
            )
            self._scalar(f"expert_load_max_over_mean/layer_{i}", summary["max_over_mean"], step)
            self._scalar(
                f"experts_without_tokens/layer_{i}", summary["experts_without_tokens"], step
            )

    def _device_memory(self, step: int, stats: dict) -> None:
        assert self.writer is not None
        for key in ("bytes_in_use", "peak_bytes_in_use"):
            if key in stats:
                self._scalar(f"device_memory/{key}_gib", stats[key] / GIB, step)

    def _scalar(self, key: str, value: float, step: int) -> None:
        """One scalar; a non-finite one left out (the module docstring), the first named."""
        assert self.writer is not None
        if math.isfinite(value):
            self.writer.add_scalar(key, value, step)
            return
        if not self.left_out:
            print(
                f"expertax: {key} is {value} at step {step}: TensorBoard leaves out non-finite "
                "values (this one and any later; metrics.jsonl records them as null)",
                file=sys.stderr,
            )
        self.left_out += 1
