"""What `expertax generate` decodes from: a training run folder or a converted model directory.

`open_source` reads the saved config, applies the command's `key=value` overrides, finds the
tokenizer and the special token ids, all without reading a parameter, so every refusal comes
before the weights are read or anything compiles; `load_params` reads the parameters.

- A run folder (`<base_output_directory>/<run_name>`): its config.yml, the parameters of its
  latest complete checkpoint, the tokenizer of its `tokenizer_path` key; a run on synthetic
  data reads and writes its numbers as text (`data.synthetic.number_tokenizer`).
- A model directory (`expertax convert from-hf` output, train/model_dir.py): its config.yml and
  parameters (read straight into the decoding mesh's shardings), its `tokenizer.json` (copied
  from the HF folder by from-hf), and from hf_config.json the BOS/EOS ids and
  `max_position_embeddings`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import tokenizers
from jax.sharding import Mesh

from expertax.config.loader import config_rules, parse_overrides
from expertax.config.schema import LAYOUT, MODEL, Config, key_kind
from expertax.data.synthetic import number_tokenizer
from expertax.data.tokenizer import DocumentEncoder, load_tokenizer
from expertax.decoding.loop import DECODING_KEYS, decoding_config
from expertax.errors import ConfigError
from expertax.models import decoder
from expertax.nn import param
from expertax.preflight import build_config
from expertax.train import checkpoint, model_dir, params_io

RUN, MODEL_DIR = "run folder", "model directory"

# Keys outside the `layout` kind that decoding reads (the compute dtype, the MoE path and its
# sums, the EP receive buffers, the longest prompt): with the layout keys, what an override
# may set. Any other key either changes the weights' meaning (kind `model`) or is not read.
READ_BY_DECODING = (
    "dtype",
    "sparse_matmul",
    "float32_weight_sum",
    "ragged_buffer_factor",
    "max_target_length",
)


@dataclasses.dataclass(frozen=True)
class Source:
    """A checked source: its config with the overrides, and what decoding needs besides."""

    path: Path
    kind: str  # RUN or MODEL_DIR
    config: Config  # the saved config with the command's overrides applied
    step: int | None  # run folder: the checkpoint step read
    hf_config: dict | None  # model directory converted from HF: its config.json
    tokenizer: tokenizers.Tokenizer | None
    tokenizer_path: str | None
    bos_id: int | None  # prepended to text prompts
    eos_id: int | None  # a sequence stops after it
    max_length: int | None  # the positions the model takes (None: the config's)

    def describe(self) -> str:
        at = f", step {self.step}" if self.step is not None else ""
        return f"{self.kind} {self.path}{at}"


def kind_of(path: Path) -> str:
    """RUN or MODEL_DIR; a ConfigError naming `path` and what would be valid otherwise."""
    if params_io.is_run_dir(path):
        return RUN
    if (path / model_dir.MARKER).is_file():
        return MODEL_DIR
    what = "does not exist" if not path.exists() else "is neither"
    raise ConfigError(
        f"SOURCE {str(path)!r} {what}: give a training run folder "
        f"(<base_output_directory>/<run_name>, with config.yml and "
        f"{params_io.CHECKPOINT_SUBDIR}/{checkpoint.MARKER_FILE}) or an expertax model directory "
        f"(the output of `expertax convert from-hf`, with {model_dir.MARKER})"
    )


def with_overrides(saved: Config, items: list[str]) -> Config:
    """`saved` with `key=value` overrides applied and validated as any config is; keys of kind
    `model`, keys decoding sets itself and keys decoding does not read are refused."""
    values = parse_overrides(items)
    for key, value in values.items():
        if key not in Config.model_fields:
            continue  # build_config names it, with the closest key
        kind = key_kind(key)
        if kind == MODEL:
            raise ConfigError(
                f"{key}={value!r}: a model key; the saved parameters were made with "
                f"{key}={getattr(saved, key)!r} and would not match"
            )
        if key in DECODING_KEYS:
            raise ConfigError(
                f"{key}={value!r}: decoding sets {key}={DECODING_KEYS[key]!r} itself "
                "(no pipeline stages, paged stash or token drops while generating)"
            )
        if kind != LAYOUT and key not in READ_BY_DECODING:
            hint = "; give the tokenizer with --tokenizer PATH" if key == "tokenizer_path" else ""
            raise ConfigError(
                f"{key}={value!r}: a {kind} key that generate does not read; it takes layout "
                f"keys (`expertax train --help-keys`) and {', '.join(READ_BY_DECODING)}{hint}"
            )
    if not values:
        return saved
    return build_config({**saved.model_dump(), **values})


def _saved_config(path: Path, kind: str) -> tuple[Config, int | None, dict | None]:
    """(config as saved, run checkpoint step, HF config), read without the parameters."""
    if kind == RUN:
        step = params_io.latest_run_step(path)[0]
        if step is None:
            raise ConfigError(
                f"SOURCE {str(path)!r}: a run folder without a complete checkpoint yet; wait for "
                "its first one (checkpoint_period) or give another source"
            )
        return params_io.read_run_config(path), step, None
    try:
        c = model_dir.read_config(path)
    except ValueError as e:  # a foreign marker, a config.yml that does not load
        raise ConfigError(f"SOURCE {str(path)!r}: {e}") from None
    hf_path = path / model_dir.HF_CONFIG
    hf = json.loads(hf_path.read_text()) if hf_path.is_file() else None
    return c, None, hf


def _tokenizer(
    path: Path, kind: str, c: Config, given: str | None
) -> tuple[tokenizers.Tokenizer | None, str | None]:
    """--tokenizer, else the run's tokenizer_path (a synthetic-data run: its numbers as words),
    else the model directory's tokenizer.json."""
    if given is not None:
        try:
            return load_tokenizer(given), given
        except ValueError as e:
            raise ConfigError(f"--tokenizer: {e}") from None
    if kind == RUN and c.tokenizer_path:
        try:
            return load_tokenizer(c.tokenizer_path), c.tokenizer_path
        except ValueError as e:
            raise ConfigError(f"the run's {e}; give the tokenizer with --tokenizer PATH") from None
    if kind == RUN and c.dataset_type == "synthetic":
        return number_tokenizer(c.vocab_size), SYNTHETIC_TOKENIZER
    file = path / model_dir.TOKENIZER_FILES[0]
    if kind == MODEL_DIR and file.is_file():
        try:
            return load_tokenizer(str(file)), str(file)
        except ValueError as e:
            raise ConfigError(f"SOURCE {str(path)!r}: {e}") from None
    return None, None


# `Source.tokenizer_path` of a synthetic-data run (its tokenizer is made, not read).
SYNTHETIC_TOKENIZER = "synthetic data's numbers (token id i is the word 'i')"


def _hf_id(hf: dict | None, key: str) -> int | None:
    """A token id of the HF config (its first, where it lists several)."""
    value = (hf or {}).get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else int(value)


def open_source(path: str | Path, overrides: list[str], tokenizer: str | None = None) -> Source:
    """The checked source at `path` (see the module doc); ConfigError for anything refused."""
    p = Path(path).resolve()
    kind = kind_of(p)
    saved, step, hf = _saved_config(p, kind)
    c = with_overrides(saved, overrides)
    tok, tok_path = _tokenizer(p, kind, saved, tokenizer)
    encoder = DocumentEncoder.from_tokenizer(tok) if tok is not None else None
    bos = _hf_id(hf, "bos_token_id")
    eos = _hf_id(hf, "eos_token_id")
    if encoder is not None:
        bos = encoder.bos_id if bos is None else bos
        eos = encoder.eos_id if eos is None else eos
    limit = (hf or {}).get("max_position_embeddings")
    return Source(
        path=p,
        kind=kind,
        config=c,
        step=step,
        hf_config=hf,
        tokenizer=tok,
        tokenizer_path=tok_path,
        bos_id=bos,
        eos_id=eos,
        max_length=None if limit is None else int(limit),
    )


def load_params(source: Source, mesh: Mesh) -> tuple[Any, Source]:
    """The source's parameters, and the source with the checkpoint step read: a model
    directory's read straight into `mesh`'s shardings (a model larger than one device loads), a
    run checkpoint's onto the first device (an older one where the newest cannot be read)."""
    if source.kind == RUN:
        _, params, step = params_io.load_run_params(source.path)
        return params, dataclasses.replace(source, step=step)
    c = decoding_config(source.config)  # the tree and rules `generate` places them with
    shardings = param.shardings(decoder.spec(c), mesh, config_rules(c))
    return model_dir.load(source.path, shardings)[1], source
