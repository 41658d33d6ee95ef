"""`profiler=xplane`: a jax.profiler trace of profiler_steps steps, in <run dir>/profile.

The window starts skip_first_n_steps_for_profiler steps into this process's run (so compilation
and the first, slower steps stay out) and ends after the last profiled step has finished on the
device. jax.profiler writes `profile/plugins/profile/<time>/<host>.xplane.pb` (TensorBoard's profile
plugin: `tensorboard --logdir <run dir>/profile`) and `<host>.trace.json.gz` (Perfetto). Every
process traces its own host.
"""

from __future__ import annotations

from pathlib import Path

import jax

from expertax.config.schema import Config

PROFILE_SUBDIR = "profile"


class Profiler:
    """Call `before(step)` before dispatching a step and `after(step, out)` after it."""

    def __init__(self, c: Config, run_path: Path, start_step: int):
        self.path = run_path / PROFILE_SUBDIR
        self.first = start_step + c.skip_first_n_steps_for_profiler if c.profiler else None
        self.last = -1 if self.first is None else self.first + c.profiler_steps - 1
        self.active = False

    def before(self, step: int) -> None:
        if step == self.first:
            self.path.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.path), create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, out) -> None:
        if self.active and step == self.last:
            jax.block_until_ready(out)
            self.stop()

    def stop(self) -> None:
        """End the trace (also when the run stops inside the window)."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()
