"""SwiGLU MLP: silu(x @ wi_0) * (x @ wi_1) @ wo."""

from __future__ import annotations

import jax

from expertax.nn.linear import project
from expertax.nn.param import Param, params_dataclass, projection
from expertax.parallel import remat
from expertax.sharding import constrain


@params_dataclass
class MLP:
    wi_0: Param  # [D, F]
    wi_1: Param  # [D, F]
    wo: Param  # [F, D]


def spec(d: int, f: int) -> MLP:
    return MLP(
        wi_0=projection((d, f), ("embed", "mlp"), d),
        wi_1=projection((d, f), ("embed", "mlp"), d),
        wo=projection((f, d), ("mlp", "embed"), f),
    )


def apply(p: MLP, x_BTD: jax.Array, dtype) -> jax.Array:
    gate = remat.tag(project(x_BTD, p.wi_0.astype(dtype)), remat.MLPWI_0)
    up = remat.tag(project(x_BTD, p.wi_1.astype(dtype)), remat.MLPWI_1)
    h_BTF = constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
    out = project(h_BTF, p.wo.astype(dtype))
    return remat.tag(out, remat.MLPWO)
