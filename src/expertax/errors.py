"""The user-error type every layer raises: a leaf module, so a refusal in nn, sharding or train
does not import the config package (the config checks raise it too)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in the configuration or the input; its message says what to change."""
