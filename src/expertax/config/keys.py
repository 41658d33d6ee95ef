"""What every config key is built from: the key kinds, the field constructor that records a key's
kind, the section base class, and the shared value types."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DType = Literal["float32", "bfloat16", "float16"]

# The mesh axes, in mesh order; each has ici_<axis>_parallelism and dcn_<axis>_parallelism keys.
MESH_AXES = ("pipeline", "data", "fsdp", "context", "expert", "tensor")

# What a key changes, declared with the key (`_key(KIND, default, ...)`); one classification used
# by the resume check, the `load_parameters_path` check, `--help-keys` and docs/keys.md. What
# each kind means is KIND_MEANINGS below.
MODEL = "model"
TRAINING = "training"
DATA = "data"
LAYOUT = "layout"
RUN = "run"
KINDS = (MODEL, TRAINING, DATA, LAYOUT, RUN)
KIND_MEANINGS = {
    MODEL: "the parameters' shapes and what they compute: saved weights need the same values",
    TRAINING: "the numbers of later steps (optimizer, precision, drops), not the weights",
    DATA: "the data stream (its files, order and sequence length)",
    LAYOUT: "how the same numbers are computed: mesh, kernels, remat, batch per device",
    RUN: "where the run goes, how long, logging, checkpoints, processes",
}
# A resumed run (or a restart before its first checkpoint) must agree on these kinds.
SAME_RUN_KINDS = (MODEL, TRAINING, DATA)


def _key(kind: str, default: Any, **kwargs: Any) -> Any:
    """A config field whose metadata says which kind of key it is (see KINDS)."""
    if kind not in KINDS:
        raise ValueError(f"unknown key kind {kind!r}; use one of {KINDS}")
    return Field(default, json_schema_extra={"kind": kind}, **kwargs)


class _Section(BaseModel):
    # every float key finite (inf and nan refused with the key named: loader._validation_message)
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, frozen=True, allow_inf_nan=False
    )
