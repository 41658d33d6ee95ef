"""Field-against-field checks of the run: data, evaluation, profiling, processes."""

from __future__ import annotations

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
