"""expertax: train Mixture-of-Experts language models in JAX.

Public API:
    load_config(*preset_files, overrides=...) -> Config
    init_params(config, key=None) -> params
    logits(params, tokens, config) -> float32 [B, T, V]
    load_hf(path) -> (config, params)   a HuggingFace DeepSeek-V3 or Mixtral checkpoint
"""

from expertax.config import Config, ConfigError, load_config
from expertax.convert import load_hf
from expertax.models import abstract_params, init_params, logits

__all__ = [
    "Config",
    "ConfigError",
    "abstract_params",
    "init_params",
    "load_config",
    "load_hf",
    "logits",
]
