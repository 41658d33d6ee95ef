"""HuggingFace <-> expertax conversion (DeepSeek-V3, Mixtral); see docs/design/convert.md.

load_hf(hf_dir) -> (config, params)          an HF checkpoint, ready for `expertax.logits`
from_hf(hf_dir, out_dir) -> Config            HF checkpoint -> expertax model directory
to_hf(ckpt_dir, out_dir) -> list of files     expertax model or training run dir -> HF checkpoint
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp

from expertax.config import Config
from expertax.convert.hf import params_from_hf, write_hf
from expertax.convert.hf_config import ConversionError, config_from_hf, config_to_hf
from expertax.train import model_dir, params_io


def load_hf(hf_dir: str | Path) -> tuple[Config, object]:
    """The Config and parameters (jax arrays) of an HF DeepSeek-V3 or Mixtral checkpoint."""
    c, params, _ = params_from_hf(hf_dir)
    return c, jax.tree.map(jnp.asarray, params)


def from_hf(hf_dir: str | Path, out_dir: str | Path) -> Config:
    """Convert an HF checkpoint directory into an expertax model directory (see `model_dir`)."""
    model_dir.check_new_dir(out_dir)  # before the (long) conversion, not after
    c, params, hf = params_from_hf(hf_dir)
    model_dir.save(out_dir, c, params, source="huggingface", hf_config=hf)
    return c


def to_hf(ckpt_dir: str | Path, out_dir: str | Path, *, max_shard_bytes: int = 5 * 2**30):
    """Convert into config.json + safetensors for transformers: an expertax model directory, or
    a training run directory (`<base_output_directory>/<run_name>`: the parameters of its latest
    complete checkpoint)."""
    model_dir.check_new_dir(out_dir)
    if params_io.is_run_dir(ckpt_dir):
        c, params, _ = params_io.load_run_params(ckpt_dir)
        hf = _source_hf_config(c)
    else:
        c, params, hf = model_dir.load(ckpt_dir)
    return write_hf(params, c, out_dir, base_config=hf, max_shard_bytes=max_shard_bytes)


def _source_hf_config(c: Config) -> dict | None:
    """The HF config.json a run started from (through load_parameters_path), if still there: it
    supplies the fields expertax does not model (token ids, max_position_embeddings)."""
    path = Path(c.load_parameters_path) / model_dir.HF_CONFIG
    if not c.load_parameters_path or not path.is_file():
        return None
    return json.loads(path.read_text())


__all__ = [
    "ConversionError",
    "config_from_hf",
    "config_to_hf",
    "from_hf",
    "load_hf",
    "to_hf",
    "write_hf",
]
