"""The memory planner: what a train step holds per device, compiled ahead of time, and the search
for a layout that fits (`expertax memory`, `expertax memory --fit`).

One job per module:
- `plan.py`: compile the train step abstractly and account for its bytes (`memory_report`);
- `residuals.py`: the activations each layer saves for its backward pass, by checkpoint name;
- `stash.py`: the paged stash's shared buffers against what the stashed names cost without it;
- `pipeline.py`: pipeline stages: the schedule and what one stage holds;
- `hlo.py`: parsers of XLA's text dumps (live ranges, buffer shapes, HLO with stack frames);
- `attribute.py`: the largest buffers alive at the compiled peak and where our code built them;
- `format.py`: the report as text and as JSON-ready data;
- `space.py`, `estimate.py`, `fit.py`: the `--fit` search: candidates, their analytic estimate,
  compiling them best-first.
"""
