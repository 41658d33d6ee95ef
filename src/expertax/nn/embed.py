"""Token embedding lookup: a gather, or a one-hot matmul only while the one-hot is small.

A one-hot matmul ("iota embed") can be faster on TPUs, but it materializes a [B, T, V] one-hot:
8 x 4096 x 102400 in bfloat16 is 6.7 GB. Seed 3922 keeps it only below 2 GiB; above, and by
default, the lookup is `jnp.take`, whose temporaries do not grow with the vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ONE_HOT_LIMIT_BYTES = 2 * 1024**3


def one_hot_bytes(ids_BT: jax.Array, vocab: int, dtype) -> int:
    b, t = ids_BT.shape
    return b * t * vocab * jnp.dtype(dtype).itemsize


def lookup(table_VD: jax.Array, ids_BT: jax.Array, dtype, *, use_iota: bool = False) -> jax.Array:
    """Rows of the table [V, D] for integer ids [B, T], as [B, T, D] in `dtype`."""
    vocab = table_VD.shape[0]
    if use_iota and one_hot_bytes(ids_BT, vocab, dtype) < ONE_HOT_LIMIT_BYTES:
        onehot_BTV = jax.nn.one_hot(ids_BT, vocab, dtype=dtype)
        return jnp.einsum("btv,vd->btd", onehot_BTV, table_VD.astype(dtype))
    return jnp.take(table_VD, ids_BT, axis=0).astype(dtype)
