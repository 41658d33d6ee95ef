"""Names of the activations a user may keep for the backward pass, and remat policies.

Every such tensor is tagged with `checkpoint_name(x, NAME)` exactly where it is produced, using
the constants below (never string literals elsewhere). A policy decides, per name, whether the
tensor is kept on device or recomputed.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

DECODER_LAYER_INPUT = "decoder_layer_input"
QUERY_PROJ = "query_proj"
KEY_PROJ = "key_proj"
VALUE_PROJ = "value_proj"
QKV_PROJ = "qkv_proj"
ATTENTION_OUT = "attention_out"
OUT_PROJ = "out_proj"
MLPWI_0 = "mlpwi_0"
MLPWI_1 = "mlpwi_1"
MLPWO = "mlpwo"
MOE_MLPWI_0 = "moe_mlpwi_0"
MOE_MLPWI_1 = "moe_mlpwi_1"
MOE_MLPWO = "moe_mlpwo"
QUERY_WA_PROJ = "query_wa_proj"
KV_WA_PROJ = "kv_wa_proj"
MLA_Q = "mla_q"
MLA_KV = "mla_kv"

ALL_NAMES = (
    DECODER_LAYER_INPUT,
    QUERY_PROJ,
    KEY_PROJ,
    VALUE_PROJ,
    QKV_PROJ,
    ATTENTION_OUT,
    OUT_PROJ,
    MLPWI_0,
    MLPWI_1,
    MLPWO,
    MOE_MLPWI_0,
    MOE_MLPWI_1,
    MOE_MLPWO,
    QUERY_WA_PROJ,
    KV_WA_PROJ,
    MLA_Q,
    MLA_KV,
)


def tag(x: jax.Array, name: str) -> jax.Array:
    """Tag an activation with its checkpoint name (one place, so names stay the constants)."""
    return checkpoint_name(x, name)


def policy(remat_policy: str):
    """The jax.checkpoint policy for a preset, or None when layers are not rematerialized."""
    if remat_policy == "none":
        return None
    if remat_policy == "full":
        return jax.checkpoint_policies.save_only_these_names(DECODER_LAYER_INPUT)
    raise ValueError(f"remat_policy={remat_policy!r}; valid: full, none")
