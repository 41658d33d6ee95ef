"""Every config key's bad values, generated from the schema, are refused by `build_config` with a
ConfigError naming the key: a value of the wrong type, inf and nan for numbers, one past each
bound, the empty string where a text key needs one, a word outside a key's choices. Run over the
defaults and over model presets, in-process (no compile)."""

from __future__ import annotations

import math
import typing

import pytest

from expertax.config import Config, ConfigError, configs_dir
from expertax.config.loader import read_yaml
from expertax.preflight import build_config

KEYS = list(Config.model_fields)
PRESETS = ("mixtral-tiny", "deepseek3-tiny", "gpt-oss-tiny")

# Number keys whose range is not one interval, bounded by a check instead (its message says
# which values are valid): key -> values that check refuses.
CHECKED_RANGES = {
    "capacity_factor": [0.0, -0.5, -2.0],  # -1 (dropless) or > 0
    "ragged_buffer_factor": [0.0, -0.5, -2.0],  # -1 (worst case) or > 0
    "synthetic_noise": [-0.1, 1.0, 1.5],  # [0, 1)
}


def _bounds(field) -> dict[str, float]:
    """The field's declared bounds (pydantic keeps them as annotated-types metadata)."""
    out = {}
    for meta in field.metadata:
        for name in ("ge", "gt", "le", "lt", "min_length"):
            value = getattr(meta, name, None)
            if value is not None:
                out[name] = value
    return out


def _past_bounds(field, step: float) -> list:
    b = _bounds(field)
    out = []
    if "ge" in b:
        out.append(b["ge"] - step)
    if "gt" in b:
        out += [b["gt"], b["gt"] - step]
    if "le" in b:
        out.append(b["le"] + step)
    if "lt" in b:
        out += [b["lt"], b["lt"] + step]
    return out


def bad_values(name: str) -> list:
    """The values of config key `name` that its type or bounds refuse."""
    field = Config.model_fields[name]
    kind = field.annotation
    if typing.get_origin(kind) is typing.Literal:
        return [f"not-a-{name}", 7, None, list(typing.get_args(kind)[:1])]
    if kind is bool:
        return ["maybe", 2, 0.5, None, []]
    if kind is int:
        return ["many", 1.5, None, [1], math.inf, math.nan, *_past_bounds(field, 1)]
    if kind is float:
        bad = ["much", None, [1.0], math.inf, -math.inf, math.nan, *_past_bounds(field, 0.5)]
        return bad + CHECKED_RANGES.get(name, [])
    if kind is str:
        return [5, None, ["text"], *([""] if _bounds(field).get("min_length") else [])]
    raise AssertionError(f"{name}: a type the walk does not know ({kind}); add its bad values")


def _preset(name: str) -> dict:
    return {"model_name": name, **read_yaml(configs_dir() / "models" / f"{name}.yml")}


BASES = {"defaults": {}, **{name: _preset(name) for name in PRESETS}}


def test_every_number_key_is_bounded():
    """Every int and float key declares a bound (ge/gt/le/lt) or is bounded by a check."""
    loose = [
        name
        for name, field in Config.model_fields.items()
        if field.annotation in (int, float) and not _bounds(field) and name not in CHECKED_RANGES
    ]
    assert loose == []


@pytest.mark.parametrize("base", list(BASES))
def test_the_bases_are_valid(base):
    """Negative control: each base builds as it is, so a refusal below is the bad value's."""
    build_config(BASES[base])


@pytest.mark.parametrize("key", KEYS)
def test_a_bad_value_is_refused_naming_the_key(key):
    values = bad_values(key)
    assert values
    for base in BASES.values():
        for value in values:
            with pytest.raises(ConfigError) as e:
                build_config({**base, key: value})
            assert f"{key}=" in str(e.value), (key, value, str(e.value))


def test_the_walk_runs_thousands_of_cases():
    cases = sum(len(bad_values(k)) for k in KEYS) * len(BASES)
    assert len(KEYS) > 150 and cases > 2000, (len(KEYS), cases)
