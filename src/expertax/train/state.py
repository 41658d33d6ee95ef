"""The train state: parameters, optimizer state, step and RNG key."""

from __future__ import annotations

import dataclasses
from typing import Any

from expertax.nn.param import params_dataclass


@params_dataclass
class TrainState:
    """A pytree; its leaves are arrays, or in derived trees their shardings or abstract values."""

    step: Any  # int32 scalar
    params: Any  # models.decoder.Decoder
    opt_state: Any  # optax state
    rng: Any  # typed PRNG key


def replace(state: TrainState, **changes) -> TrainState:
    return dataclasses.replace(state, **changes)
