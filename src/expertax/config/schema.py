"""The typed configuration schema.

One flat namespace of globally unique keys (so `key=value` works on the command line), grouped in
sections for reading: the model's keys in `model_keys.py`, the training, layout and run keys in
`run_keys.py`, what they are built from (key kinds, `_key`) in `keys.py`. Key names follow
MaxText's where the concept is the same. Every field has a description; derived values are
properties, never written back. Cross-field checks that do not need the device count live in
`checks.py`; those that do (mesh sizes) in `sharding/mesh.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from expertax.config.keys import (
    DATA,
    KINDS,
    LAYOUT,
    MESH_AXES,
    MODEL,
    RUN,
    SAME_RUN_KINDS,
    TRAINING,
    DType,
)
from expertax.config.model_keys import ModelSection, MoESection
from expertax.config.run_keys import (
    DataSection,
    DistributedSection,
    ObserveSection,
    ParallelSection,
    RematSection,
    TrainSection,
)

__all__ = [
    "DATA",
    "KINDS",
    "LAYOUT",
    "MESH_AXES",
    "MODEL",
    "RUN",
    "SAME_RUN_KINDS",
    "SECTIONS",
    "TRAINING",
    "Config",
    "DType",
    "ModelSection",
    "MoESection",
    "RematSection",
    "changed_keys",
    "key_kind",
    "keys_of_kind",
]


class Config(
    ModelSection,
    MoESection,
    ParallelSection,
    TrainSection,
    RematSection,
    DataSection,
    DistributedSection,
    ObserveSection,
):
    """The whole configuration; see the sections for the keys."""

    @property
    def num_dense_layers(self) -> int:
        if self.num_experts <= 1:
            return self.base_num_decoder_layers
        return self.first_num_dense_layers

    @property
    def num_moe_layers(self) -> int:
        return self.base_num_decoder_layers - self.num_dense_layers

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0

    @property
    def pipeline_stages(self) -> int:
        """Stages S: the `pipeline` mesh axis (ici x dcn)."""
        return self.ici_pipeline_parallelism * self.dcn_pipeline_parallelism

    @property
    def pipelined_stack(self) -> str:
        """The layer stack the pipeline runs: "moe" for an MoE model, else "dense"."""
        return "moe" if self.is_moe else "dense"

    @property
    def pipelined_layers(self) -> int:
        """Layers run by the pipeline (the first ones of `pipelined_stack`); 0 without one."""
        if self.pipeline_stages == 1:
            return 0
        stack = self.num_moe_layers if self.is_moe else self.num_dense_layers
        return stack if self.pipeline_parallel_layers == -1 else self.pipeline_parallel_layers

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches M per step (num_pipeline_microbatches, -1 = the stages)."""
        m = self.num_pipeline_microbatches
        return self.pipeline_stages if m == -1 else m

    @property
    def pipeline_bubble_fraction(self) -> float:
        """Idle share of the pipelined layers' time: (S - 1) / (M * R + S - 1)."""
        s = self.pipeline_stages
        return (s - 1) / (self.pipeline_microbatches * self.num_pipeline_repeats + s - 1)

    @property
    def uses_routing_groups(self) -> bool:
        return self.n_routing_groups > 1

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width used by the attention scores."""
        if self.attention_type == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def attention_windows(self) -> tuple[int | None, ...]:
        """One cycle of the layers' sliding windows (None: full attention), layer l taking
        entry l mod its length: `attention_layer_pattern` with `sliding_window_size`
        (checks.check_layer_pattern refuses a pattern that is not one)."""
        text = self.attention_layer_pattern.strip()
        kinds = [k.strip() for k in text.split(",")] if text else []
        if not kinds:
            kinds = ["sliding" if self.sliding_window_size else "full"]
        return tuple(self.sliding_window_size if k == "sliding" else None for k in kinds)

    @property
    def attn_v_head_dim(self) -> int:
        return self.v_head_dim if self.attention_type == "mla" else self.head_dim


SECTIONS = (
    ModelSection,
    MoESection,
    ParallelSection,
    TrainSection,
    RematSection,
    DataSection,
    DistributedSection,
    ObserveSection,
)


def key_kind(name: str) -> str:
    """The kind (MODEL, TRAINING, DATA, LAYOUT or RUN) declared with config key `name`."""
    extra = Config.model_fields[name].json_schema_extra
    if not isinstance(extra, dict) or extra.get("kind") not in KINDS:
        raise KeyError(f"config key {name!r} declares no kind")
    return str(extra["kind"])


def keys_of_kind(*kinds: str) -> tuple[str, ...]:
    """The config keys of the given kinds, in schema order."""
    return tuple(k for k in Config.model_fields if key_kind(k) in kinds)


def changed_keys(old: Mapping[str, Any], new: Config, kinds: Iterable[str]) -> list[str]:
    """`"key: old -> new"` for each key of `kinds` whose value in `new` differs from `old` (a
    saved config's values; a key missing there counts as its default), in schema order."""
    kinds = tuple(kinds)
    out = []
    for key, field in Config.model_fields.items():
        if key_kind(key) not in kinds:
            continue
        before, after = old.get(key, field.default), getattr(new, key)
        if before != after:
            out.append(f"{key}: {before!r} -> {after!r}")
    return out
