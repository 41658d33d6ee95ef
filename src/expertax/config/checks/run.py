"""Field-against-field checks of the run: data, evaluation, profiling, processes, the run's
name; and `check_paths`, the files and folders a training run reads (by the train command,
before any backend starts: a saved config whose files have since moved still loads)."""

from __future__ import annotations

import glob
from pathlib import Path

from expertax.config.schema import Config
from expertax.errors import ConfigError
from expertax.paths import cannot_write_in, nearest_existing, not_a_file, what_is


def check_data_files(c: Config) -> None:
    if c.dataset_type != "files":
        return
    missing = [k for k in ("dataset_path", "tokenizer_path") if not getattr(c, k)]
    if missing:
        raise ConfigError(
            f"dataset_type=files needs {' and '.join(missing)}: set "
            + " ".join(f"{k}=..." for k in missing)
            + " (a data file, directory or glob; a tokenizer.json)"
        )


def check_synthetic_noise(c: Config) -> None:
    p = c.synthetic_noise
    if not 0 <= p < 1:
        raise ConfigError(
            f"synthetic_noise={p}: use a probability in [0, 1) (the share of target tokens "
            "replaced by uniform random ones; 0 = off)"
        )
    if p and c.dataset_type != "synthetic":
        raise ConfigError(
            f"synthetic_noise={p} applies to synthetic data only, not dataset_type="
            f"{c.dataset_type}; set synthetic_noise=0"
        )


def check_routing_replay(c: Config) -> None:
    """routing_replay=true needs an MoE stack that takes an imposed routing as it is
    (models/decoder.py `run_stack`) and keeps every imposed assignment (no capacity drops)."""
    if not c.routing_replay:
        return
    why = ""
    if not c.is_moe:
        why = f"the model has no MoE layers (num_experts={c.num_experts}): nothing to replay"
    elif c.pipelined_stack == "moe" and c.pipelined_layers:
        why = (
            f"the MoE layers are pipelined (ici_pipeline_parallelism={c.ici_pipeline_parallelism}"
            f", dcn_pipeline_parallelism={c.dcn_pipeline_parallelism}); the pipeline takes no "
            "imposed routing: set both to 1"
        )
    elif c.moe_paged_stash:
        why = "moe_paged_stash=true takes no imposed routing; set moe_paged_stash=false"
    elif c.capacity_factor != -1:
        why = (
            f"capacity_factor={c.capacity_factor} drops assignments over an expert's capacity, "
            "so the sampler's routing would not be replayed whole; set capacity_factor=-1 "
            "(dropless)"
        )
    if why:
        raise ConfigError(f"routing_replay=true: {why}; or set routing_replay=false")


def check_qk_clip(c: Config) -> None:
    """use_qk_clip=true needs MLA (each head owns its query and key projections) and the layouts
    whose attention sees a layer's whole batch and sequence in one place: the largest logit
    leaves the layer as a gradient (nn/attention/qk_clip.py), which sums what a pipeline's
    microbatches, a context split's shards or query chunks would each give."""
    if not c.use_qk_clip:
        return
    why = ""
    if c.attention_type != "mla":
        why = (
            f"attention_type={c.attention_type}: QK-clip rescales each head's own query and key "
            "projections, which GQA's shared key heads do not have (MaxText: MLA only)"
        )
    elif c.pipelined_layers:
        why = (
            f"ici_pipeline_parallelism={c.ici_pipeline_parallelism}, dcn_pipeline_parallelism="
            f"{c.dcn_pipeline_parallelism}: a pipeline's microbatches would add their largest "
            "logits; set both to 1"
        )
    elif c.ici_context_parallelism != 1:
        why = (
            f"ici_context_parallelism={c.ici_context_parallelism}: the context split's attention "
            "is not measured; set it to 1"
        )
    elif c.num_attention_token_chunks > 1:
        why = (
            f"num_attention_token_chunks={c.num_attention_token_chunks}: the chunks would add "
            "their largest logits; set it to 1"
        )
    if why:
        raise ConfigError(f"use_qk_clip=true: {why}; or set use_qk_clip=false")


def check_eval(c: Config) -> None:
    if c.eval_dataset_path and not c.tokenizer_path:
        raise ConfigError(
            f"eval_dataset_path={c.eval_dataset_path!r} needs tokenizer_path (the held-out files "
            "are tokenized like the training files); set tokenizer_path=... or "
            'eval_dataset_path="" (a held-out synthetic stream)'
        )


def check_profiler(c: Config) -> None:
    if c.profiler and c.skip_first_n_steps_for_profiler >= c.steps:
        raise ConfigError(
            f"profiler={c.profiler} with skip_first_n_steps_for_profiler="
            f"{c.skip_first_n_steps_for_profiler} and steps={c.steps} would never profile; use "
            f'skip_first_n_steps_for_profiler in 0..{c.steps - 1}, or profiler="" (off)'
        )


def check_distributed(c: Config) -> None:
    n, i = c.num_processes, c.process_id
    if n == 0:
        raise ConfigError("num_processes=0: use a positive count or -1 (from $JAX_NUM_PROCESSES)")
    if n > 0 and i >= n:
        raise ConfigError(f"process_id={i} must be below num_processes={n}")


# Besides letters and digits (of any script), the characters a run's folder name may hold.
RUN_NAME_PUNCTUATION = "-_.+@"
NAME_MAX_BYTES = 255  # a folder name's limit on Linux and macOS file systems


def check_run_name(c: Config) -> None:
    """`run_name` is one plain folder name under `base_output_directory`: not a path, at most
    255 bytes, of letters, digits and `RUN_NAME_PUNCTUATION` (no spaces, brackets, quotes, glob or
    shell characters: `run_name=[a,b]` is not a list, and not a folder anyone wants to type)."""
    name = c.run_name
    if not name:
        return
    size = len(name.encode())
    odd = sorted({ch for ch in name if not (ch.isalnum() or ch in RUN_NAME_PUNCTUATION)})
    if name in (".", ".."):
        why = "is not a folder name: a run is one folder under base_output_directory"
    elif "/" in name or "\\" in name:
        why = "holds path separators: a run is one folder under base_output_directory"
    elif size > NAME_MAX_BYTES:
        why = f"is {size} bytes long; a folder name holds at most {NAME_MAX_BYTES}"
    elif odd:
        why = f"holds {', '.join(map(repr, odd))}, which a folder name should not"
    else:
        return
    raise ConfigError(
        f"run_name={name if size <= 80 else name[:60] + '...'!r} {why}; use a plain folder name "
        f"of letters, digits and {' '.join(RUN_NAME_PUNCTUATION)} (e.g. run_name=moe-ep8), or "
        '"" (a timestamp)'
    )


def check_coordinator_address(c: Config) -> None:
    address = c.coordinator_address
    if not address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"coordinator_address={address!r}: use host:port of process 0 (e.g. "
            '10.0.0.1:1234, a port in 1..65535), or "" (from $JAX_COORDINATOR_ADDRESS)'
        )


def _data_files(key: str, path: str) -> None:
    """A file, a folder or a glob that names something (the files' kinds: data/files.py)."""
    kind = what_is(path)
    if kind in ("a file", "a folder") or (kind == "missing" and glob.glob(path, recursive=True)):
        return
    if kind != "missing":
        raise ConfigError(
            f"{key}={path!r} is {kind}, not a file; give a data file, a folder of them or a glob "
            "(.jsonl, .parquet, .txt)"
        )
    raise ConfigError(
        f"{key}={path!r}: no such file or folder, and no file matches it as a glob; give a "
        "data file, a folder of them or a glob (.jsonl, .parquet, .txt)"
    )


def _tokenizer(path: str) -> None:
    p = Path(path)
    if p.is_file() or (p / "tokenizer.json").is_file():
        return
    why = not_a_file(p)
    where = f"{str(p)!r} is a folder without tokenizer.json" if p.is_dir() else f"it {why}"
    raise ConfigError(
        f"tokenizer_path={path!r}: {where}; give a HuggingFace tokenizer.json or its folder"
    )


def _model_dir(path: str) -> None:
    p = Path(path)
    if p.is_dir() and (p / "config.yml").is_file():
        return
    kind = what_is(p)
    where = {"a folder": "a folder without config.yml", "missing": "no such folder"}.get(kind, kind)
    raise ConfigError(
        f"load_parameters_path={path!r}: {where}; give an expertax model directory (the output "
        "of `expertax convert from-hf`, with config.yml)"
    )


def check_paths(c: Config) -> None:
    """The files and folders a training run of `c` reads exist and are of the right kind; the
    output folder is not a file. ConfigError naming the key and the path."""
    if c.dataset_type == "files":
        _data_files("dataset_path", c.dataset_path)
    if c.eval_interval and c.eval_dataset_path:
        _data_files("eval_dataset_path", c.eval_dataset_path)
    if c.tokenizer_path:  # read for files and held-out data; a missing one is a mistake anyway
        _tokenizer(c.tokenizer_path)
    if c.load_parameters_path:
        _model_dir(c.load_parameters_path)
    _output_folder(c.base_output_directory)


def _output_folder(path: str) -> None:
    """`base_output_directory` is a folder, or can be made one: its nearest existing ancestor is
    a folder this process may write in."""
    out = Path(path)
    kind = what_is(out)
    if kind not in ("a folder", "missing"):
        raise ConfigError(
            f"base_output_directory={path!r} is {kind}; runs are written in folders under it: "
            "give a folder (new or existing)"
        )
    ancestor = nearest_existing(out)
    if not ancestor.is_dir():
        raise ConfigError(
            f"base_output_directory={path!r}: {str(ancestor)!r} on its way is a file, so the "
            "folder cannot be made; give a folder (new or existing)"
        )
    why = cannot_write_in(ancestor)
    if why is not None:
        raise ConfigError(
            f"base_output_directory={path!r}: no folder can be made in {str(ancestor)!r} "
            f"({why}); give a folder you can write in"
        )
