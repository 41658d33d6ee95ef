"""The config.yml that expertax writes into a run folder or a model directory, read back.

Such a file is `config_to_yaml` of a resolved Config: a YAML mapping of config keys that ends with
a newline. One that is empty, cut off, not YAML, not a mapping, or a mapping without a single
config key is damaged (or someone else's), and is named as such: reading it as the built-in
defaults would compare a run against values it never had.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from expertax.config.loader import read_yaml
from expertax.config.schema import Config
from expertax.errors import ConfigError


def read_saved(path: str | Path, fix: str) -> dict[str, Any]:
    """The values of the saved config file `path`; a ConfigError naming the file, what is wrong
    with it and `fix` (what to do) when it is not an expertax config as expertax writes one."""
    values, wrong = read(Path(path))
    if wrong is not None:
        raise ConfigError(f"{path} {wrong}; {fix}")
    return values


def read(path: Path) -> tuple[dict[str, Any], str | None]:
    """(values, None), or ({}, what is wrong with the file: "is empty", "is damaged (...)",
    "is not an expertax config (...)", "is missing")."""
    if not path.is_file():
        return {}, "is missing"
    try:
        text = path.read_bytes().decode()
    except UnicodeDecodeError:
        return {}, "is damaged (not UTF-8 text)"
    if not text.strip():
        return {}, "is empty"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return {}, "is damaged (not valid YAML)"
    if data is None or data == {}:
        return {}, "is empty (no keys)"
    if not isinstance(data, dict):
        return {}, f"is not an expertax config (it holds a {type(data).__name__}, not config keys)"
    try:
        values = read_yaml(path)  # typed as the keys take them (`run_name: off`)
    except ConfigError as e:  # a value cut to a word its key does not take
        return {}, f"is damaged ({e})"
    if not any(k in Config.model_fields for k in values):
        return {}, (
            f"is not an expertax config (none of its keys {sorted(map(str, values))[:5]} is a "
            "config key)"
        )
    if not text.endswith("\n"):  # yaml.safe_dump ends every file with a newline
        return {}, "is damaged (cut off inside its last line)"
    return values, None
