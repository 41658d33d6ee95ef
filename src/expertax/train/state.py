"""The train state: parameters, optimizer state, step and RNG key."""

from __future__ import annotations

import dataclasses

import jax

from expertax.nn.param import params_dataclass


@params_dataclass
class TrainState:
    step: jax.Array  # int32 scalar
    params: object
    opt_state: object
    rng: jax.Array  # typed PRNG key


def replace(state: TrainState, **changes) -> TrainState:
    return dataclasses.replace(state, **changes)
