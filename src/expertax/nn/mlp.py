"""Gated MLP: act(x @ wi_0, x @ wi_1) @ wo, `act` the SwiGLU (nn/activation.py)."""

from __future__ import annotations

import jax

from expertax.nn.activation import GatedActivation, joined, swiglu
from expertax.nn.linear import is_joint, project
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


def apply(p: MLP, x_BTD: jax.Array, dtype, act: GatedActivation = swiglu) -> jax.Array:
    """`act(x wi_0, x wi_1) wo` (`act`: the config's, `activation.of`). `wi_0` may hold
    `wi_0 | wi_1` side by side (`linear.Joint`, `wi_1` None: decoding's layout on one device):
    one product, split by the activation."""
    if is_joint(p.wi_0):
        h_BTF = joined(project(x_BTD, p.wi_0.w.astype(dtype)), act)
        return project(h_BTF, p.wo.astype(dtype))
    gate = remat.tag(project(x_BTD, p.wi_0.astype(dtype)), remat.MLPWI_0)
    up = remat.tag(project(x_BTD, p.wi_1.astype(dtype)), remat.MLPWI_1)
    h_BTF = constrain(act(gate, up), ("batch", "length", "act_mlp"))
    out = project(h_BTF, p.wo.astype(dtype))
    return remat.tag(out, remat.MLPWO)
