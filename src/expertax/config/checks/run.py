"""Field-against-field checks of the run: data, evaluation, profiling, processes, the run's
name; and `check_paths`, the files and folders a training run reads (by the train command,
before any backend starts: a saved config whose files have since moved still loads)."""

from __future__ import annotations

import glob
import os
import tempfile
from pathlib import Path

from expertax.config.schema import Config
from expertax.errors import ConfigError


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


def check_run_name(c: Config) -> None:
    """`run_name` is one folder under `base_output_directory`, not a path."""
    name = c.run_name
    if name and (name in (".", "..") or "/" in name or "\\" in name):
        raise ConfigError(
            f"run_name={name!r}: a run is one folder under base_output_directory; use a plain "
            'name without path separators (e.g. run_name=moe-ep8), or "" (a timestamp)'
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
    if Path(path).exists() or glob.glob(path, recursive=True):
        return
    raise ConfigError(
        f"{key}={path!r}: no such file or folder, and no file matches it as a glob; give a "
        "data file, a folder of them or a glob (.jsonl, .parquet, .txt)"
    )


def _tokenizer(path: str) -> None:
    p = Path(path)
    if p.is_file() or (p / "tokenizer.json").is_file():
        return
    where = f"{str(p)!r} is a folder without tokenizer.json" if p.is_dir() else "no such file"
    raise ConfigError(
        f"tokenizer_path={path!r}: {where}; give a HuggingFace tokenizer.json or its folder"
    )


def _model_dir(path: str) -> None:
    p = Path(path)
    if p.is_dir() and (p / "config.yml").is_file():
        return
    where = (
        "a file"
        if p.is_file()
        else "a folder without config.yml"
        if p.is_dir()
        else "no such folder"
    )
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
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"base_output_directory={path!r} is a file; runs are written in folders under it: "
            "give a folder (new or existing)"
        )
    ancestor = out.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(
            f"base_output_directory={path!r}: {str(ancestor)!r} on its way is a file, so the "
            "folder cannot be made; give a folder (new or existing)"
        )
    try:  # a folder made and removed at once: what os.access cannot tell (root, /proc, mounts)
        os.rmdir(tempfile.mkdtemp(prefix=".expertax-check-", dir=ancestor))
    except OSError as e:
        raise ConfigError(
            f"base_output_directory={path!r}: no folder can be made in {str(ancestor)!r} "
            f"({e.strerror}); give a folder you can write in"
        ) from None
