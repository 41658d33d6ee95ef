"""The routed experts' products under a recipe, and the one choice between them and the plain ones.

`products(c, dtype, sizes, offset, d, f)` is the MoE layer's one seam (nn/moe/dispatch.py's
sorted path calls it whether or not a recipe is set): the `gmm.ExpertProducts` of the layer,
read from the `linear.fp8` context that `decoder.block_apply` sets (config key `quantization`).
- no recipe: `gmm.GroupedProducts`, the grouped matmuls on `gmm_impl`'s backend;
- a recipe: `Fp8Products`, fp8/matmul.py's grouped GEMMs, the gated activation inside the
  second (its fp8 inputs are what it saves), on Hopper's kernel where fp8/kernel.py says (D
  and the local F), the layer's probe split into the rows' and the output gradients' counts.

What the paged stash (nn/moe/stash.py) holds under a recipe, asked of `buffers`: the gate and
up (`HELD`) as what the backward reads, the activation's inputs in 1 x 128 e4m3 tiles, one byte
per value in `name` and the float32 scales of each row in `name + SCALE` (F/128 per row;
`fp8_tensorwise`: the one scale, repeated per row), DeepSeek-V3's cached SwiGLU inputs. Its
read mode hands them to the gated activation as its residuals (`held`): the gradients are
bitwise those of the plain fp8 stack that keeps the same names. The output rows stay in the
compute dtype (the combine is bf16 in the recipe).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from expertax.fp8 import kernel, matmul, recipes
from expertax.nn import activation, linear
from expertax.nn.activation import GatedActivation
from expertax.nn.moe.gmm import ExpertProducts, GroupedProducts
from expertax.parallel import remat

if TYPE_CHECKING:
    from expertax.config.schema import Config

TILE = recipes.TILE
HELD = (remat.MOE_MLPWI_0, remat.MOE_MLPWI_1)  # the names the paged stash holds in fp8
SCALE = "/scale"  # the buffer of an fp8-held name's row scales: name + SCALE


def products(c: Config, dtype, group_sizes_E, group_offset, d: int, f: int) -> ExpertProducts:
    """The expert products of an MoE layer whose local experts are D = `d` wide with a local
    MLP dim `f`, over rows sorted by group (`group_sizes_E`; `group_offset`: the first local
    group, or None), in the compute `dtype`: under the recipe traced now, or plain."""
    recipe, probe = linear.current_fp8(), linear.current_fp8_probe()
    kw: dict[str, Any] = dict(
        group_offset=group_offset,
        tile_rows=c.gmm_tile_rows,
        tile_rows_min=c.gmm_tile_rows_min,
    )
    act = activation.of(c)
    if not recipe:
        return GroupedProducts(group_sizes_E, act, dict(kw, backend=c.gmm_impl))
    backend = kernel.routed(c.gmm_impl, recipe, d, f)
    # the probes of the rows' (K) and the output gradients' (N) counts: gate and up read D-wide
    # rows, the down projection writes them (fp8.stats.Probe)
    in_probes = None if probe is None else (probe.model_lanes, probe.lanes)
    out_probes = None if probe is None else (probe.lanes, probe.model_lanes)
    kw = dict(kw, backend=backend)
    return Fp8Products(recipe, jnp.dtype(dtype), group_sizes_E, act, kw, in_probes, out_probes)


@dataclasses.dataclass(frozen=True)
class Fp8Products:
    """`gmm.ExpertProducts` under `recipe` (the module docstring); `kw` as `GroupedProducts`'s."""

    recipe: str
    dtype: jnp.dtype
    group_sizes_E: jax.Array
    act: GatedActivation
    kw: dict[str, Any]
    in_probes: tuple | None
    out_probes: tuple | None

    def project(self, rows_MD, w_EDF, name: str, given: dict[str, jax.Array]) -> jax.Array:
        # untagged: the names go on grouped_glu's fp8 copies of gate and up
        g = given.get(name)
        if (q := held(given, name, self.recipe)) is not None:
            # the matmul's value is read by nothing but the gated activation, which takes
            # `held` instead (matmul.grouped_glu): no fprop, its backward as ever
            g = recipes.dequantize(q, self.dtype, 1, TILE)
        sizes, probes = self.group_sizes_E, self.in_probes
        return matmul.grouped(rows_MD, w_EDF, sizes, self.recipe, given=g, probes=probes, **self.kw)

    def glu(
        self, gate_MF, up_MF, wo_EFD, given: dict[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        # the activation's inputs kept in fp8 under gate's and up's names
        qs = tuple(held(given, n, self.recipe) for n in HELD)
        y = matmul.grouped_glu(
            gate_MF, up_MF, wo_EFD, self.group_sizes_E, self.recipe, self.act, HELD,
            given=given.get(remat.MOE_MLPWO), held=qs, probes=self.out_probes, **self.kw,
        )  # fmt: skip
        # what a paged stash writes of them: the same quantized tiles the activation saves
        values: dict[str, jax.Array] = {}
        for name, a in zip(HELD, (gate_MF, up_MF)):
            values.update(stash_values(name, recipes.quantize(a, self.recipe, 1, TILE)))
        return remat.tag(y, remat.MOE_MLPWO), values


def buffers(c: Config, name: str, width: int, dtype) -> dict[str, tuple[int, jnp.dtype]]:
    """The paged stash's buffers for the stashed `name` of rows `width` wide: (row width, value
    dtype) each. `name` in `dtype` (the compute dtype), or, under the recipe `quantization`, a
    `HELD` name as e4m3 plus a buffer of its float32 row scales (`scale_columns`)."""
    if c.quantization and name in HELD:
        scales = (scale_columns(c.quantization, width), jnp.dtype(jnp.float32))
        return {name: (width, jnp.dtype(jnp.float8_e4m3fn)), name + SCALE: scales}
    return {name: (width, jnp.dtype(dtype))}


def scale_columns(recipe: str, width: int) -> int:
    """The float32 scales an fp8-held row of `width` values carries: one per 1 x 128 tile
    (recipes.quantize: a shorter row is one tile), or the tensorwise scale once."""
    if recipe == "fp8_tensorwise":
        return 1
    return -(-width // min(TILE, width))


def stash_values(name: str, q) -> dict[str, jax.Array]:
    """The buffers' values of an fp8-held name from its quantized rows `q` = (e4m3 [M, W],
    scales [M, W/128] or the tensorwise scalar, repeated per row)."""
    values, scale = q
    rows = values.shape[0]
    scale = jnp.broadcast_to(scale, (rows, 1)) if scale.ndim == 0 else scale
    return {name: values, name + SCALE: scale}


def held(given: dict[str, jax.Array], name: str, recipe: str):
    """The quantized rows (e4m3, scales) of an fp8-held `name` read back from `given` (the
    stash's read mode's values), in `recipes.quantize`'s form (tensorwise: the scalar, the
    largest of the rows' copies: the rows outside the layer's are zero), or None when the stash
    holds none."""
    if name not in given or name + SCALE not in given:
        return None
    scale = given[name + SCALE]
    return given[name], jnp.max(scale) if recipe == "fp8_tensorwise" else scale
