"""The converter's error and its field checks, shared by the per-family mappings."""

from __future__ import annotations

from typing import Any

from expertax.config import ConfigError


class ConversionError(ConfigError):
    """An HF checkpoint or config that expertax cannot represent exactly; says which field."""


class ShapeError(ConversionError):
    """A tensor whose shape is not the one its config.json implies."""


def require(hf: dict, key: str, allowed: tuple, default: Any = None) -> None:
    """ConversionError naming HF field `key`, its value and the supported values, unless its
    value (`default` when absent) is one of `allowed`."""
    value = hf.get(key, default)
    if value not in allowed:
        raise ConversionError(
            f"HF config field {key}={value!r} is not supported by expertax (supported: "
            f"{', '.join(repr(a) for a in allowed)})"
        )


def require_keys(c, family: str, wanted: dict[str, Any]) -> None:
    """ConversionError naming every Config key of `c` whose value differs from `wanted` (what
    the HF layout of `family` can hold), with the value it needs."""
    wrong = [
        f"{key}={getattr(c, key)!r} (needs {value!r})"
        for key, value in wanted.items()
        if getattr(c, key) != value
    ]
    if wrong:
        raise ConversionError(
            f"decoder_block={family!r} has no HF equivalent with {', '.join(wrong)}"
        )
