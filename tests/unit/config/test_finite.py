"""Every float key is finite: inf, -inf and nan are refused with the key named, before anything
is built (a NaN learning rate once trained and saved NaN parameters)."""

from __future__ import annotations

import math
import typing

import pytest

from expertax.config import Config, ConfigError, build_fields

FLOAT_KEYS = [
    name
    for name, field in Config.model_fields.items()
    if field.annotation is float or float in typing.get_args(field.annotation)
]


def test_there_are_float_keys():
    assert len(FLOAT_KEYS) >= 10 and "learning_rate" in FLOAT_KEYS


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, "inf", "nan"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_a_non_finite_float_is_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"^{key}=.*finite"):
        build_fields({key: value})


def test_a_finite_float_is_taken():
    """Negative control: the same path takes a finite value."""
    assert build_fields({"learning_rate": 3e-4}).learning_rate == 3e-4
