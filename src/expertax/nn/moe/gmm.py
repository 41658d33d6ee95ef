"""Grouped matrix multiply: rows sorted by group, each group multiplied by its own weight matrix.

`gmm(lhs_ND, rhs_EDF, group_sizes_E)` computes, for rows of group e, `lhs_ND[rows] @ rhs_EDF[e]`.
Rows beyond `sum(group_sizes)` produce zeros. With `group_offset`, only groups
`[group_offset, group_offset + E_local)` are local: `rhs` holds those E_local experts and
`group_sizes` still covers all experts (rows of non-local groups produce zeros).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BACKENDS = ("auto", "ragged_dot")


def gmm(
    lhs_ND,
    rhs_EDF,
    group_sizes_E,
    *,
    group_offset=None,
    backend: str = "auto",
    preferred_element_type=None,
):
    """Grouped matmul `[N, D] x [E, D, F] -> [N, F]` (see the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"gmm backend={backend!r}; valid: {', '.join(BACKENDS)}")
    out_dtype = preferred_element_type or lhs_ND.dtype
    if group_offset is None:
        return jax.lax.ragged_dot(
            lhs_ND, rhs_EDF, group_sizes_E.astype(jnp.int32), preferred_element_type=out_dtype
        )
    # ragged_dot's group_offset is not implemented everywhere; select the local groups instead.
    e_local = rhs_EDF.shape[0]
    sizes = jax.lax.dynamic_slice_in_dim(group_sizes_E.astype(jnp.int32), group_offset, e_local)
    start = jnp.sum(jnp.where(jnp.arange(group_sizes_E.shape[0]) < group_offset, group_sizes_E, 0))
    rolled = jnp.roll(lhs_ND, -start, axis=0)
    out = jax.lax.ragged_dot(rolled, rhs_EDF, sizes, preferred_element_type=out_dtype)
    return jnp.roll(out, start, axis=0)
