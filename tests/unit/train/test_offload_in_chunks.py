"""A MoE name offloaded inside MoE token chunks is refused on GPU and TPU before anything is
traced (parallel.checks.check_moe_chunk_offload: neither compiler lays out the chunks' host buffer),
and built on a CPU, where the offload is a placement only."""

import jax
import pytest

from expertax import targets
from expertax.config import ConfigError
from expertax.preflight import load_config
from expertax.train.trainer import build_trainer

OVER = {
    "model_name": "mixtral-tiny",
    "ici_expert_parallelism": 8,
    "ici_fsdp_parallelism": 1,
    "remat_policy": "custom",
    "moe_mlpwo": "offload",
    "max_target_length": 64,
}


@pytest.mark.parametrize("spec", ["gpu:h100x8", "tpu:v5p-16"])
def test_refused_on_accelerators(spec):
    platform = spec.split(":")[0]
    if not targets.compiler_available(platform):
        pytest.skip(f"the {platform} compiler (expertax[{platform}]) is missing")
    devices = targets.parse_target(spec).devices()
    c = load_config(overrides={**OVER, "num_moe_token_chunks": 4})
    with pytest.raises(ConfigError, match="num_moe_token_chunks=4 with moe_mlpwo=offload"):
        build_trainer(c, devices)
    build_trainer(load_config(overrides={**OVER, "num_moe_token_chunks": 1}), devices)


def test_built_on_cpu():
    c = load_config(overrides={**OVER, "num_moe_token_chunks": 4})
    build_trainer(c, jax.devices()[:8])
