"""expertax: train Mixture-of-Experts language models in JAX.

Public API:
    load_config(*preset_files, overrides=...) -> Config
    init_params(config, key=None) -> params
    logits(params, tokens, config) -> float32 [B, T, V]
    load_hf(path) -> (config, params)   a HuggingFace checkpoint (DeepSeek, GLM-4.5, Mixtral, Qwen3)
    generate(params, config, prompt_ids, ...) -> Generation   sample with a KV cache

The names load on first use, so that `import expertax.<module>` (the `expertax` command's
start-up, `expertax.hostmem`) does not import JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_MODULE_OF = {
    "Config": "expertax.config",
    "ConfigError": "expertax.errors",
    "load_config": "expertax.preflight",
    "Generation": "expertax.decoding",
    "generate": "expertax.decoding",
    "load_hf": "expertax.convert",
    "abstract_params": "expertax.models",
    "init_params": "expertax.models",
    "logits": "expertax.models",
}

__all__ = [
    "Config",
    "ConfigError",
    "Generation",
    "abstract_params",
    "generate",
    "init_params",
    "load_config",
    "load_hf",
    "logits",
]

if TYPE_CHECKING:
    from expertax.config import Config, ConfigError
    from expertax.convert import load_hf
    from expertax.decoding import Generation, generate
    from expertax.models import abstract_params, init_params, logits
    from expertax.preflight import load_config


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name]), name)
    raise AttributeError(f"module 'expertax' has no attribute {name!r}")
