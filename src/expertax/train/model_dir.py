"""The converted-model directory: a config and the parameters, saved with Orbax.

```
OUT_DIR/
  expertax_model.json   marker {"format": "expertax-model", "version": 1, "source": ...}
  config.yml            the full resolved Config (every key), loadable by `expertax train`
  hf_config.json        the source HF config.json (only when converted from HF)
  params/               Orbax StandardCheckpointer save of the `Decoder` parameter pytree
```
The parameter tree is exactly `models.decoder.Decoder` (as `init_params` returns it), each leaf
in its own stored dtype (the HF DeepSeek routing bias stays float32 next to bfloat16 weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from expertax.config import Config, build_config, config_to_yaml
from expertax.config.loader import read_yaml
from expertax.models import decoder
from expertax.nn.param import is_spec

FORMAT = "expertax-model"
FORMAT_VERSION = 1
MARKER = "expertax_model.json"
PARAMS_DIR = "params"
HF_CONFIG = "hf_config.json"


def check_new_dir(out_dir: str | Path) -> Path:
    """`out_dir` resolved; a file or a non-empty directory is refused (nothing is overwritten)."""
    out = Path(out_dir).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output directory {out} is not empty; choose a new one")
    return out


def save(out_dir: str | Path, c: Config, params, *, source: str, hf_config: dict | None = None):
    """Write a converted-model directory; `out_dir` must not exist or be empty."""
    out = check_new_dir(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yml").write_text(config_to_yaml(c))
    if hf_config is not None:
        (out / HF_CONFIG).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    # Synchronous, and numpy leaves written in place: Orbax's default NumpyHandler deep-copies
    # every host array first (a second copy of the whole model), which a 671B conversion cannot
    # afford. `save_concurrent_gb` bounds the bytes in flight.
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ocp.type_handlers.ArrayHandler()),
    )
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry, save_concurrent_gb=4)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(out / PARAMS_DIR, args=ocp.args.PyTreeSave(params))
    marker = {"format": FORMAT, "version": FORMAT_VERSION, "source": source}
    (out / MARKER).write_text(json.dumps(marker) + "\n")


def read_config(ckpt_dir: str | Path) -> Config:
    """The Config of an expertax model directory; ValueError if `ckpt_dir` is not one."""
    path = Path(ckpt_dir).resolve()
    marker = path / MARKER
    if not marker.is_file():
        raise ValueError(f"{path} is not an expertax model directory (no {MARKER})")
    try:
        content = json.loads(marker.read_text())
    except ValueError:
        content = None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise ValueError(f"{path}: {MARKER} is not expertax's")
    return build_config(read_yaml(path / "config.yml"))


def load(ckpt_dir: str | Path, shardings=None) -> tuple[Config, decoder.Decoder, dict | None]:
    """(Config, parameters, source HF config or None).

    Parameters land on the first device, or in `shardings` (a `Decoder` tree of shardings, e.g.
    `nn.param.shardings(decoder.spec(c), mesh, rules)`), read straight into each shard by Orbax.
    """
    path = Path(ckpt_dir).resolve()
    c = read_config(path)
    hf_path = path / HF_CONFIG
    hf_config = json.loads(hf_path.read_text()) if hf_path.is_file() else None
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path / PARAMS_DIR)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        spec = decoder.spec(c)
        if shardings is None:
            shardings = jax.tree.map(lambda _: device, spec, is_leaf=is_spec)

        def target(key_path, s, sharding):
            node = tree
            for k in key_path:
                node = node[k.name]
            return jax.ShapeDtypeStruct(s.shape, node.dtype, sharding=sharding)

        abstract = jax.tree_util.tree_map_with_path(target, spec, shardings, is_leaf=is_spec)
        params = ckptr.restore(path / PARAMS_DIR, abstract)
    return c, params, hf_config
