"""Decoding: sample from a model with KV caches (`generate`), the `expertax generate` command's
engine. See docs/design/generate.md."""

from expertax.decoding.cache import bytes_per_token, values_per_token
from expertax.decoding.loop import Generation, check_request, decoding_config, generate, prepare

__all__ = [
    "Generation",
    "bytes_per_token",
    "check_request",
    "decoding_config",
    "generate",
    "prepare",
    "values_per_token",
]
