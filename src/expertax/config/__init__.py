"""Typed configuration: schema, checks and loading (presets, overrides, rules tables)."""

from expertax.config.loader import (
    build_config,
    config_rules,
    config_to_yaml,
    configs_dir,
    load_config,
    load_rules,
)
from expertax.config.schema import Config
from expertax.errors import ConfigError

__all__ = [
    "Config",
    "ConfigError",
    "build_config",
    "config_rules",
    "config_to_yaml",
    "configs_dir",
    "load_config",
    "load_rules",
]
