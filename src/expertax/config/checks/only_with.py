"""Keys that apply only under another setting, as one table: such a key given by the user (on
the command line or in a YAML file of theirs) while its setting is off would be silently ignored,
so it is refused, naming the key, its value and the setting it needs. A value that comes from
the model's preset is kept without a word: a preset carries a feature's sizes (YaRN's factors,
the MTP loss weight, the stash's sizes) so that one key turns the feature off and on
(`config.loader.load_fields` knows which keys the user gave; a flat mapping, `build_fields`,
is a whole config, not the user's words, and is not held to this table).

Kept to the clear cases: a key that changes nothing without the setting. Keys that MaxText's
convention accepts whatever else is set (a kernel's tiles under another kernel, `a2a_impl` without
expert parallelism, the profiler's step counts with the profiler off, the MLA dims of a GQA
model) are not listed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

from expertax.config.schema import Config
from expertax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class OnlyWith:
    """`keys` take effect only when `applies(config)`; `setting` says what that needs."""

    keys: tuple[str, ...]
    setting: str
    applies: Callable[[Config], bool]


ONLY_WITH: tuple[OnlyWith, ...] = (
    OnlyWith(
        (
            "rope_factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "rope_yarn_truncate",
        ),
        "rope_type=yarn",
        lambda c: c.rope_type == "yarn",
    ),
    OnlyWith(
        ("mlp_activation_limit",),
        "mlp_activation=swiglu_clamped",
        lambda c: c.mlp_activation == "swiglu_clamped",
    ),
    OnlyWith(("routed_bias_update_rate",), "routed_bias=true", lambda c: c.routed_bias),
    OnlyWith(
        ("routing_group_score", "topk_routing_group"),
        "n_routing_groups > 1",
        lambda c: c.uses_routing_groups,
    ),
    OnlyWith(
        (
            "muon_beta",
            "muon_weight_decay",
            "muon_consistent_rms",
            "muon_include_routers",
            "muon_ns_steps",
            "muon_ns_dtype",
        ),
        "opt_type=muon",
        lambda c: c.opt_type == "muon",
    ),
    OnlyWith(("qk_clip_threshold",), "use_qk_clip=true", lambda c: c.use_qk_clip),
    OnlyWith(("checkpoint_period",), "enable_checkpointing=true", lambda c: c.enable_checkpointing),
    OnlyWith(("mtp_loss_scaling_factor",), "mtp_num_layers > 0", lambda c: c.mtp_num_layers > 0),
    OnlyWith(
        ("moe_paged_stash_capacity_factor", "moe_paged_stash_page_rows"),
        "moe_paged_stash=true",
        lambda c: c.moe_paged_stash,
    ),
    OnlyWith(
        ("dataset_path", "data_num_epochs"),
        "dataset_type=files",
        lambda c: c.dataset_type == "files",
    ),
    OnlyWith(
        ("data_text_field", "data_worker_count"),
        "dataset_type=files or eval_dataset_path",
        lambda c: c.dataset_type == "files" or bool(c.eval_dataset_path),
    ),
    OnlyWith(("eval_dataset_path",), "eval_interval > 0", lambda c: c.eval_interval > 0),
)


def check_only_with(c: Config, given: Collection[str], preset: Mapping[str, Any]) -> None:
    """ConfigError for the first key of `ONLY_WITH` that the user `given` a value other than the
    model's `preset` one (else the schema's default) while its setting is off: a saved config
    given back as a file repeats its preset's values and passes."""
    for rule in ONLY_WITH:
        if rule.applies(c):
            continue
        for key in rule.keys:
            default = Config.model_fields[key].default
            reference = preset.get(key, default)
            value = getattr(c, key)
            if key in given and value not in (reference, default):  # the default: "off"
                raise ConfigError(
                    f"{key}={value!r} applies only with {rule.setting}, which is not set, so it "
                    f"would be ignored; set {rule.setting}, or leave {key} at "
                    f"{reference!r} (the {'preset' if key in preset else 'default'})"
                )
