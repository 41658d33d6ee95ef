"""Which parameters decoding holds in fp8 (`fp8_weights=True`), in the device layout of
fp8/quant.py (`Fp8`: e4m3 values, a float32 scale per 128 values of the input axis).

DeepSeek-V3's 671B parameters take 1.34 TB in bfloat16, more than 8 H200s (1.13 TB) or a
v5p-16 slice (8 chips, 760 GiB) hold; in fp8 they take half. Every matrix of the decoder layers
and the MTP modules (attention projections, dense and shared MLPs, routed experts, `eh_proj`) is
held in the device layout (`quantized`, `spec`, `quantize`); embeddings, the output head, norms
and the router (and its bias) stay in their own dtype, as in the hub checkpoint. Each layer's
weights are dequantized to `dtype` where the layer runs (`fp8.quant.dequantize`, decoding/model.py).
The quantization runs on the devices after the parameters are loaded in their own dtype: a
model whose bfloat16 weights do not fit the devices cannot be loaded this way yet (the compiled
figures of such a model, benchmarks/generate_671b.py, take the fp8 tree as given).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from expertax.fp8.quant import E4M3, Fp8, block, is_fp8, quantize_array
from expertax.nn.param import ParamSpec, is_spec

# Parameter containers whose matrices are quantized (norm scales and the router never are).
QUANTIZED_PARENTS = ("attn", "mlp", "moe", "shared", "mtp")


def _names(path) -> list[str]:
    return [str(getattr(k, "name", getattr(k, "key", ""))) for k in path]


def quantized(path, shape: tuple[int, ...], prefix: tuple[str, ...] = ()) -> bool:
    """Whether the parameter at `path` (a key path into the Decoder tree, or into a layer's tree
    that sits at `prefix` in it, e.g. ("mtp",) for an MTP module) is held in fp8."""
    names = [*prefix, *_names(path)]
    if not names or names[-1].endswith("norm") or "router" in names:
        return False
    return len(shape) >= 2 and any(n in QUANTIZED_PARENTS for n in names[:-1])


def spec(tree, prefix: tuple[str, ...] = ()):
    """The parameter declaration tree with each quantized ParamSpec replaced by an Fp8 of two
    ParamSpecs (values, scales; the scales keep the weight's logical axes)."""
    if tree is None:
        return None

    def one(path, s: ParamSpec):
        if not quantized(path, s.shape, prefix):
            return s
        k, n = s.shape[-2:]
        scale_shape = (*s.shape[:-2], k // block(k), n)
        return Fp8(s, ParamSpec(scale_shape, s.axes, "ones", weight_decay=False))

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_spec)


def abstract(tree, dtype) -> Any:
    """ShapeDtypeStructs of an `spec` tree: fp8 values, float32 scales, the rest in `dtype`."""

    def leaf(s, dt):
        return jax.ShapeDtypeStruct(s.shape, dt)

    def one(x):
        if is_fp8(x):
            return Fp8(leaf(x.q, E4M3), leaf(x.scale, jnp.float32))
        return leaf(x, jnp.dtype(dtype))

    return jax.tree.map(one, tree, is_leaf=lambda x: is_fp8(x) or is_spec(x))


def quantize(params, prefix: tuple[str, ...] = ()):
    """The parameters with every quantized weight (`quantized`) as Fp8."""

    def one(path, w):
        return quantize_array(w) if quantized(path, w.shape, prefix) else w

    return jax.tree_util.tree_map_with_path(one, params)
