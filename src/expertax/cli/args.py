"""The config arguments the commands share: `PRESET.yml` files and `key=value` overrides."""

from __future__ import annotations

CONFIG_HELP = "PRESET.yml files and key=value overrides"


def split_args(items: list[str]) -> tuple[list[str], list[str]]:
    from expertax.config import ConfigError

    files = [a for a in items if "=" not in a]
    overrides = [a for a in items if "=" in a]
    for f in files:
        if not f.endswith((".yml", ".yaml")):
            raise ConfigError(f"argument {f!r} is neither a key=value override nor a .yml preset")
    return files, overrides


def config_from_args(items: list[str]):
    from expertax.preflight import load_config

    files, overrides = split_args(items)
    return load_config(*files, overrides=overrides)
