"""Typed configuration: schema, field checks and loading (presets, overrides, rules tables).

A config the whole program can run is `expertax.preflight.load_config` (or `build_config`): these
fields, then every subsystem's own checks."""

from expertax.config.loader import (
    build_fields,
    config_rules,
    config_to_yaml,
    configs_dir,
    load_fields,
    load_rules,
)
from expertax.config.schema import Config
from expertax.errors import ConfigError

__all__ = [
    "Config",
    "ConfigError",
    "build_fields",
    "config_rules",
    "config_to_yaml",
    "configs_dir",
    "load_fields",
    "load_rules",
]
