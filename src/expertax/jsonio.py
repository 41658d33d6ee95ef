"""Strict JSON for every file expertax writes.

JSON has no spelling for NaN or ±infinity: Python's `json` writes a bare `NaN` / `Infinity`,
which jq, JavaScript's `JSON.parse` and most other parsers reject. Here a non-finite number
(a Python float or a numpy scalar) is written as `null`, and the encoder runs with
`allow_nan=False`, so nothing non-standard can slip through. A reader takes `null` where a
number belongs as a value that was not finite (`number`).

A leaf module (the standard library only): every layer that writes a file may use it.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import IO, Any


def finite_or_none(obj: Any) -> Any:
    """`obj` with every non-finite number replaced by None, through dicts, lists and tuples
    (tuples become lists, as JSON writes them); numpy integer and float scalars become Python
    numbers. Anything else is returned as it is (json decides what it can write)."""
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_or_none(v) for v in obj]
    if isinstance(obj, bool | str) or obj is None:
        return obj
    if isinstance(obj, numbers.Integral):  # int and numpy's integers (registered with numbers)
        return int(obj)
    if isinstance(obj, numbers.Real):  # float, numpy's floats
        value = float(obj)
        return value if math.isfinite(value) else None
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """`json.dumps` of `obj` with non-finite numbers as null (`finite_or_none`); strict."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)


def dump(obj: Any, fp: IO[str], **kwargs: Any) -> None:
    """`json.dump` of `obj` with non-finite numbers as null (`finite_or_none`); strict."""
    json.dump(finite_or_none(obj), fp, allow_nan=False, **kwargs)


def number(value: Any) -> float:
    """A number read back from a file this module wrote: `null` (None) is a value that was not
    finite, read as NaN, so that `math.isfinite` still says so; other numbers as floats."""
    return math.nan if value is None else float(value)
