"""The fit search's calibration: each term of the estimate (`estimate.Terms`) scaled by what the
compiled programs of the same search hold, term by term, so that one bad guess of the model does
not prune (or keep) the whole space.

After each compile the ratios are solved again from every compiled candidate:
- `args`: the compiled arguments (the device state: parameters, optimizer state) over the
  estimate's, the median over candidates (a TPU pads some shapes; offload moves state out);
- `residual`: what one saved byte costs in compiled temporaries. It is read from two compiled
  candidates of the same working key (the same layout, rules, chunks, tiles, attention and
  batch: their working sets are the same program) whose saved residuals differ, as the slope
  of temporaries over residual bytes; before that, the platform's prior (`RESIDUAL_PRIOR`,
  measured on small models: the TPU program holds the layer scan's saved stack twice);
- `offload`: what one offloaded residual byte still costs in device temporaries, the same way
  (`OFFLOAD_PRIOR`: a third on TPU, none on GPU);
- `working`: the rest of the temporaries (less gradients and residuals) over the model's
  working set, per working key; a key not compiled yet takes the median of the keys compiled
  (1 before any compile);
- `host`: the compiled pinned-host bytes over the estimated host residuals (TPU and GPU
  programs report them apart);
- `state`: what one byte of offloaded optimizer state still costs in device temporaries
  (`STATE_PRIOR`), read from the candidates with state offloaded once candidates without it
  are compiled (whose working sets it then uses): a candidate whose offloaded state costs the
  device more than the prior says corrects this term, not the working set of every candidate.
  Only candidates whose update streams the state teach it;
- `whole`: the same for a program that copies the state in whole for the update
  (`Terms.opt_whole`): all of it (1) before one is compiled, then read from those alone; while
  other candidates are compiled, such a program teaches no other ratio (the working set's
  included).
"""

from __future__ import annotations

import dataclasses
import statistics

from expertax.planner.estimate import Terms

# Compiled temporaries per saved residual byte, by platform, before a search has read its own:
# the slope of temporaries over the layers of a layer-input-saving (remat_policy=full) step
# against the same step with the layer input offloaded (deepseek3-tiny widened to D=512, 8 x
# 1,024 tokens per device, 4 to 16 layers, 2026-11-27): 2.0 for the TPU compiler (tpu:v5p-16:
# temporaries +20.7 MiB per layer saving 8 MiB, +4.4 MiB offloaded), 1.0 for the GPU one
# (gpu:h100x8: +9.7 and +1.7 MiB per layer), 1.0 for XLA:CPU.
RESIDUAL_PRIOR = {"tpu": 2.0, "gpu": 1.0, "cpu": 1.0}
# Device temporaries per byte of saved residual offloaded to host: the same runs; the TPU
# program keeps a third of what it offloads in device buffers too (+4.4 MiB per layer
# offloading 8 MiB, of which 1.75 MiB are the layer's gradients; DeepSeek-V3 671B on
# tpu:v5p-1024 with the layer input and out_proj offloaded: 17.8 of 56 GiB at 4 x 8,192 per
# chip, 27.9 of 84 GiB at 6 x 8,192, beyond the modelled working set); the GPU one none.
OFFLOAD_PRIOR = {"tpu": 1 / 3, "gpu": 0.0, "cpu": 0.0}
# Compiled temporaries per modelled working byte, before a search has read its own: 1.0 to
# 1.2 for the 671B TPU plans (the two above, and e8 f64 remat_policy=full with 8 chunks).
WORKING_PRIOR = {"tpu": 1.05, "gpu": 1.0, "cpu": 1.0}
# Device temporaries per byte of optimizer state offloaded to pinned host memory (AdamW's
# update streaming it a layer at a time), before a search has read its own: DeepSeek-V3 671B on
# tpu:v5p-256 (e4 f32 exp-fsdp, offload-2, 16 chunks, 4 x 8,192 per chip) peaks at 114.40 GiB
# with its 19.53 GiB of state offloaded against 119.95 GiB on device, and the estimate's other
# terms account for all but 0.88 x the state (2026-12-07, libtpu 0.0.42.1). The GPU compile
# without a GPU does not honour the offload (planner/plan.py), XLA:CPU refuses it.
STATE_PRIOR = {"tpu": 0.88, "gpu": 1.0, "cpu": 1.0}
RATIO_BOUNDS = (0.25, 4.0)
WORKING_BOUNDS = (0.1, 20.0)  # a small model's fixed temporaries dwarf its modelled working set


@dataclasses.dataclass
class Compiled:
    """One compiled candidate: its estimate's terms and the program's bytes per device
    (`Measured`)."""

    key: tuple  # the working key
    terms: Terms
    measured: Measured


@dataclasses.dataclass(frozen=True)
class Measured:
    """A compiled program's bytes per device: `args` the state in device memory, `temp` the
    rest of the peak, `host` pinned host bytes (the compiler's figures on TPU and GPU; for an
    XLA:CPU plan, with its one memory, what the config places on host taken out of the device
    figures)."""

    peak: int
    args: int
    temp: int
    host: int


def _clamp(x: float, bounds: tuple[float, float] = RATIO_BOUNDS) -> float:
    return min(max(x, bounds[0]), bounds[1])


def _nearest(by_key: dict[tuple, list[float]], key: tuple | None) -> float:
    """The working ratio for `key` (mesh shape, rules, MoE chunks, tiles, attention chunks,
    attention, stash): its own key's, else that of the keys differing only in chunks and
    tiles, else its layout's
    (mesh shape and rules), else the median over the keys compiled."""
    if key in by_key:
        return statistics.median(by_key[key])
    if key is not None:
        for same in (lambda k: k[:2] == key[:2] and k[5:] == key[5:], lambda k: k[:2] == key[:2]):
            near = [v for k, vs in by_key.items() if same(k) for v in vs]
            if near:
                return statistics.median(near)
    return statistics.median(statistics.median(v) for v in by_key.values())


class Calibration:
    """Per-term ratios from the candidates compiled so far (module docstring)."""

    def __init__(self, on: str):
        self.on = on
        self.compiled: list[Compiled] = []

    def add(self, key: tuple, terms: Terms, measured: Measured | None) -> None:
        if measured is not None:  # a program refused for memory: nothing to learn from
            self.compiled.append(Compiled(key, terms, measured))

    def _slope(self, moved: str, kept: str, prior: float) -> float:
        """Temporaries per byte of term `moved` between compiled candidates of one working key
        whose term `kept` is (nearly) the same; `prior` without such a pair."""
        slopes = []
        by_key: dict[tuple, list[Compiled]] = {}
        for x in self.compiled:
            by_key.setdefault(x.key, []).append(x)
        for group in by_key.values():
            for a in group:
                for b in group:
                    dm = getattr(a.terms, moved) - getattr(b.terms, moved)
                    dk = abs(getattr(a.terms, kept) - getattr(b.terms, kept))
                    if dm > 0.05 * max(getattr(a.terms, moved), 1) and dk <= 0.05 * abs(dm):
                        slopes.append((a.measured.temp - b.measured.temp) / dm)
        if slopes:
            return min(max(statistics.median(slopes), 0.0), RATIO_BOUNDS[1])
        return prior

    def ratios(self, key: tuple | None = None) -> dict[str, float]:
        """The ratios for a candidate of working key `key`."""
        out = {
            "residual": self._slope(
                "residual_device", "residual_host", RESIDUAL_PRIOR.get(self.on, 1.0)
            ),
            "offload": self._slope(
                "residual_host", "residual_device", OFFLOAD_PRIOR.get(self.on, 0.0)
            ),
            "working": WORKING_PRIOR.get(self.on, 1.0),
            "state": STATE_PRIOR.get(self.on, 1.0),
        }
        if not self.compiled:
            return out
        args = [x.measured.args / x.terms.args for x in self.compiled if x.terms.args]
        if args:
            out["args"] = _clamp(statistics.median(args))

        def rest(t: Terms, m: Measured) -> float:
            """The temporaries the working set and the offloaded state's share leave."""
            r = m.temp - t.grads - t.params_offloaded - t.stack_copies
            return r - out["residual"] * t.residual_device - out["offload"] * t.residual_host

        # The working set's ratio from candidates whose state is all on device where any are
        # compiled, else from those that stream it: one whose offloaded state costs more device
        # memory than the prior says corrects the state's ratio, not every candidate's working
        # set; a whole copy only its own (`whole`).
        plain = [x for x in self.compiled if not x.terms.opt_offloaded]
        streaming = [x for x in self.compiled if not x.terms.opt_whole]
        working: dict[tuple, list[float]] = {}
        for x in plain or streaming or self.compiled:
            t = x.terms
            left = rest(t, x.measured) - t.state_share(out) * t.opt_offloaded
            if t.working > 0:
                working.setdefault(x.key, []).append(_clamp(left / t.working, WORKING_BOUNDS))
        if working:
            out["working"] = _nearest(working, key)

        def share(whole: bool, learn: bool) -> None:
            """The offloaded state's ratio of the candidates that stream it (`state`) or copy
            it in whole (`whole`, which holds it all and what comes with the copy), each read
            from its own kind only, so that neither corrects the other."""
            if not learn:
                return
            got = [
                (rest(x.terms, x.measured) - _nearest(working, x.key) * x.terms.working)
                / x.terms.opt_offloaded
                for x in self.compiled
                if x.terms.opt_offloaded and x.terms.opt_whole == whole
            ]
            if got:
                name = "whole" if whole else "state"
                out[name] = min(max(statistics.median(got), 0.0), RATIO_BOUNDS[1])

        share(whole=False, learn=bool(plain))
        share(whole=True, learn=bool(working))
        host = [
            (x.measured.host - x.terms.state_host) / x.terms.residual_host
            for x in self.compiled
            if x.terms.residual_host and x.measured.host > x.terms.state_host
        ]
        if host:
            out["host"] = _clamp(statistics.median(host))
        return out
