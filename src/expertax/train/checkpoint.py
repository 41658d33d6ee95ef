"""Checkpoints of a run: the train-state pytree plus a small JSON item, saved with Orbax.

One run directory holds numbered step directories written by `orbax.checkpoint.CheckpointManager`
(one composite checkpoint per step: item `state`, the train-state pytree; item `data`, a JSON
document with the data-iterator state) and a marker file, `expertax_checkpoints.json`, that tells
an expertax run directory from any other directory.

Guarantees (see docs/design/checkpoint.md):
- Saves are asynchronous: `maybe_save` returns once the arrays are copied off the device, the
  writing happens on a background thread; `wait` blocks until it is on disk.
- A save becomes visible only when complete. Orbax writes each step into a temporary directory
  (`<step>.orbax-checkpoint-tmp*`) and renames it (or, on object stores, writes a commit file) at
  the end, so a process killed mid-save leaves the previous complete step as the latest.
- Restore reads into the shardings of the abstract target, so a checkpoint saved on one mesh
  restores on any other (including one device).
- Typed PRNG key arrays (`jax.random.key`) are stored as their raw `uint32` key data
  (`jax.random.key_data`) and re-wrapped on restore with the implementation the abstract target's
  key dtype names; the file format therefore does not depend on Orbax's key support.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

PyTree = Any

FORMAT = "expertax-checkpoint"
FORMAT_VERSION = 1
MARKER_FILE = "expertax_checkpoints.json"
STATE_ITEM = "state"
DATA_ITEM = "data"
# Files of a complete step as Orbax writes them (the composite layout: the state item with OCDBT,
# one store per process, and the JSON data item), whose absence `damage` reports.
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
ORBAX_METADATA = "_METADATA"
OCDBT_MANIFEST = "manifest.ocdbt"
OCDBT_PROCESS_GLOB = "ocdbt.process_*"
OCDBT_DATA = "d"
DATA_FILE = "metadata"


def _is_key(x: Any) -> bool:
    """True for typed PRNG key arrays and their abstract values."""
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _keys_to_data(state: PyTree) -> PyTree:
    """Replaces each typed PRNG key leaf by its raw `uint32` key data (shape `[*key_shape, k]`)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)


def _abstract_key_data(abstract_key: jax.ShapeDtypeStruct) -> tuple[jax.ShapeDtypeStruct, str]:
    """The abstract key data of an abstract typed key, with its sharding, and the key impl name."""
    impls: list[str] = []

    def key_data(k):
        impls.append(jax.random.key_impl(k))
        return jax.random.key_data(k)

    # Tracing tells both the trailing key-data shape and the implementation, with no device work.
    out = jax.eval_shape(key_data, jax.ShapeDtypeStruct(abstract_key.shape, abstract_key.dtype))
    extra = out.ndim - abstract_key.ndim
    sharding = abstract_key.sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (abstract_key.ndim - len(sharding.spec) + extra)
        sharding = NamedSharding(
            sharding.mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind
        )
    elif not isinstance(sharding, SingleDeviceSharding):
        raise ValueError(
            f"typed PRNG key target has sharding {sharding!r}; restore supports NamedSharding and "
            "SingleDeviceSharding for key arrays"
        )
    return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=sharding), str(impls[0])


def _wrap_key_data(data: jax.Array, impl: str) -> jax.Array:
    return jax.random.wrap_key_data(data, impl=impl)


def _same_structure(a: Any, b: Any) -> bool:
    """PyTreeDef equality (typed Any: jaxlib's stub declares no __eq__)."""
    return bool(a == b)


def _check_abstract(abstract_state: PyTree) -> None:
    """Every array leaf of the restore target must say where it goes (its sharding)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
            raise ValueError(
                f"restore target leaf {jax.tree_util.keystr(path)} has no sharding; pass "
                "jax.ShapeDtypeStruct(shape, dtype, sharding=...) for every array"
            )


def check_directory(directory: str | os.PathLike) -> None:
    """ValueError unless `directory` is missing, empty, or an expertax checkpoint directory (it
    holds our marker file). Reads only."""
    path = epath.Path(os.fspath(directory))
    if path.exists() and not path.is_dir():
        raise ValueError(f"checkpoint directory {path} exists and is not a directory")
    if not path.exists() or not any(True for _ in path.iterdir()):
        return
    marker = path / MARKER_FILE
    if not marker.exists():
        entries = sorted(p.name for p in path.iterdir())[:5]
        raise ValueError(
            f"checkpoint directory {path} is not empty and is not an expertax checkpoint "
            f"directory (no {MARKER_FILE}; it holds {entries}); choose another directory"
        )
    try:
        content = json.loads(marker.read_bytes())
    except (OSError, ValueError) as e:  # UnicodeDecodeError included
        raise ValueError(
            f"checkpoint directory {path}: {MARKER_FILE} is damaged ({type(e).__name__}: "
            f"{str(e)[:80]}); write it back as {json.dumps(_marker())}"
        ) from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise ValueError(f"checkpoint directory {path}: {MARKER_FILE} is not expertax's")


def _marker() -> dict:
    """What the marker file holds."""
    return {"format": FORMAT, "version": FORMAT_VERSION}


def mark_directory(directory: str | os.PathLike) -> None:
    """Create `directory` and its marker file unless marked already: the one writer of markers.

    Call it from one process (process 0) and let the others wait at a barrier before they open
    the directory; the marker appears whole (written aside, then renamed).
    """
    path = epath.Path(os.fspath(directory))
    path.mkdir(parents=True, exist_ok=True)
    marker = path / MARKER_FILE
    if marker.exists():
        return
    tmp = path / f".{MARKER_FILE}.tmp"
    tmp.write_text(json.dumps(_marker()))
    tmp.rename(marker)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The step of the latest complete checkpoint in `directory` (None if there is none)."""
    fmt = ocp.path.step.standard_name_format()
    meta = ocp.path.step.latest_step_metadata(epath.Path(os.fspath(directory)), fmt)
    return None if meta is None else meta.step


def step_path(directory: str | os.PathLike, step: int) -> Path:
    """The folder of complete step `step` in `directory`."""
    fmt = ocp.path.step.standard_name_format()
    return Path(os.fspath(fmt.find_step(epath.Path(os.fspath(directory)), step).path))


def damage(directory: str | os.PathLike, step: int) -> str | None:
    """What complete step `step` of `directory` lacks of the files a save writes, or holds empty
    (None: nothing). Reads names and sizes only, not the arrays: a step that passes may still fail
    to restore (a chunk of an array gone), which `restore` reports."""
    root = step_path(directory, step)
    state = root / STATE_ITEM
    need = [root / CHECKPOINT_METADATA, root / DATA_ITEM / DATA_FILE, state / ORBAX_METADATA]
    processes = sorted(state.glob(OCDBT_PROCESS_GLOB))  # OCDBT: one store per process
    if processes or (state / OCDBT_MANIFEST).exists():
        need += [state / OCDBT_MANIFEST] + [p / OCDBT_MANIFEST for p in processes]
    wrong = [p.relative_to(root) for p in need if _empty(p)]
    if processes and all(_empty(p / OCDBT_DATA) for p in processes):  # some process wrote arrays
        wrong.append(Path(STATE_ITEM, OCDBT_PROCESS_GLOB, OCDBT_DATA))
    if not wrong:
        return None
    return "missing or empty: " + ", ".join(map(str, wrong[:4]))


def _empty(path: Path) -> bool:
    """A missing path, an empty file or an empty folder."""
    if path.is_dir():
        return not any(path.iterdir())
    return not path.exists() or path.stat().st_size == 0


def intact_steps(directory: str | os.PathLike) -> tuple[list[int], dict[int, str]]:
    """The complete steps of `directory` that lack none of their files, newest first, and the
    complete steps that do (step -> `damage`)."""
    fmt = ocp.path.step.standard_name_format()
    steps = sorted((m.step for m in fmt.find_all(epath.Path(os.fspath(directory)))), reverse=True)
    found = {step: damage(directory, step) for step in steps}
    damaged = {step: why for step, why in found.items() if why is not None}
    return [step for step in steps if step not in damaged], damaged


def latest_intact_step(directory: str | os.PathLike) -> tuple[int | None, dict[int, str]]:
    """The newest complete step of `directory` that lacks none of its files (None: there is
    none), and the newer complete steps that do (step -> `damage`), which a resume skips."""
    intact, damaged = intact_steps(directory)
    if not intact:
        return None, damaged
    return intact[0], {step: why for step, why in damaged.items() if step > intact[0]}


def first_readable(
    directory: str | os.PathLike,
    steps: list[int],
    read: Callable[[int], Any],
    agree: Callable[[bool], bool] = bool,
) -> tuple[int | None, Any, dict[int, str]]:
    """(step, `read(step)`) of the first of `steps` of `directory` (newest first) that reads, and
    the steps before it that did not (step -> why, one line); (None, None, why) when none reads.

    A step with all its files can still hold a damaged array chunk (cut short, overwritten),
    which only reading finds; TensorStore then raises a bare Exception, so every Exception
    counts. `agree(read_here)`: whether every process read it (a multi-process run moves on
    together). What a failed read leaves behind is kept quiet (`_quiet_failed_reads`)."""
    unreadable: dict[int, str] = {}
    with _quiet_failed_reads(str(directory)) as failed:
        for step in steps:
            try:
                value, why = read(step), None
            except Exception as e:  # noqa: BLE001 - TensorStore's errors are bare Exceptions
                value, why = None, _one_line(e)
                failed()
            if agree(why is None):
                return step, value, unreadable
            unreadable[step] = why or "another process could not read it"
    return None, None, unreadable


def _one_line(error: Exception, width: int = 200) -> str:
    """`error`'s first cause (Orbax wraps TensorStore's) in at most about `width` characters:
    its start and its end (TensorStore's say what it read first and what was wrong last),
    without TensorStore's spec dumps."""
    while isinstance(error.__cause__, Exception):
        error = error.__cause__
    text = " ".join(str(error).split())
    for dump in (" [tensorstore_spec", " See full TensorStore details"):
        text = text.split(dump)[0]
    if len(text) > width:
        text = f"{text[: width // 3]} ... {text[-(width - width // 3) :]}"
    return f"{type(error).__name__}: {text}"


_QUIET_IN: set[str] = set()  # checkpoint directories whose failed reads are kept quiet


@contextlib.contextmanager
def _quiet_failed_reads(directory: str) -> Iterator[Callable[[], None]]:
    """While steps of `directory` are read, and for the rest of the process once one read failed
    (call the yielded function), drop what a failed read leaves behind; the failure itself is
    reported by `first_readable`'s caller.

    Orbax closes the read's event loop at the first error while TensorStore still finishes the
    step's other reads, during the read and after it: each then calls the closed loop's
    `call_soon_threadsafe` from a TensorStore thread, and Python would print its RuntimeError
    with a traceback (`sys.unraisablehook`), as it would the error of each of the step's reads
    left unawaited when the loop closed (Orbax's coroutine, collected at exit: "Exception ignored
    in: <coroutine ...>", or "coroutine ... was never awaited" when never started), and asyncio
    would log each of their errors as "Future exception was never retrieved". Dropped: those
    RuntimeErrors, the never-awaited warnings of Orbax's read coroutines, and those errors and
    log records that name the directory; nothing else."""
    previous = sys.unraisablehook
    kept = bool(_QUIET_IN)  # installed for good by an earlier failed read

    def hook(unraisable) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        if any(directory in str(error) for directory in _QUIET_IN):  # a read left unawaited
            return
        previous(unraisable)

    if not kept:
        sys.unraisablehook = hook
        logging.getLogger("asyncio").addFilter(_not_a_failed_read)
    failures: list[bool] = []
    _QUIET_IN.add(directory)

    def failed() -> None:
        failures.append(True)
        # the read coroutines the closed loop never ran, collected at exit
        warnings.filterwarnings("ignore", _UNAWAITED_READ, RuntimeWarning)

    try:
        yield failed
    finally:
        if not failures and not kept:
            _QUIET_IN.discard(directory)
            sys.unraisablehook = previous
            logging.getLogger("asyncio").removeFilter(_not_a_failed_read)


_UNAWAITED_READ = r"coroutine '_read\w*' was never awaited"  # Orbax's read coroutines


def _not_a_failed_read(record: logging.LogRecord) -> bool:
    """False for asyncio's record of an error that a failed read left unread (above): a future's
    (`Future`, `_GatheringFuture`) or a task's exception never retrieved."""
    text = record.getMessage()
    if "exception was never retrieved" not in text.split("\n", 1)[0]:
        return True
    return not any(directory in text for directory in _QUIET_IN)


def restore_state_field(
    directory: str | os.PathLike, step: int, field: str, abstract: PyTree
) -> PyTree:
    """One top-level field of a saved train state (e.g. "params"), read alone.

    An Orbax partial restore: the other fields (the optimizer state, twice the parameters' size
    with AdamW) are never read. `abstract` gives shape, dtype and sharding per array, as in
    `Checkpointer.restore`; typed PRNG key leaves are not supported here.
    """
    _check_abstract({field: abstract})
    fmt = ocp.path.step.standard_name_format()
    path = fmt.find_step(epath.Path(os.fspath(directory)), step).path / STATE_ITEM
    restore_args = jax.tree.map(ocp.checkpoint_utils.construct_restore_args, abstract)
    args = ocp.args.PyTreeRestore(
        item={field: abstract}, restore_args={field: restore_args}, partial_restore=True
    )
    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(path, args=args)[field]


class Checkpointer:
    """Saves and restores the checkpoints of one run directory (Orbax, asynchronous).

    Args:
      directory: the run's checkpoint directory; created if missing. An existing non-empty
        directory must be an expertax checkpoint directory (it holds `expertax_checkpoints.json`).
      period_steps: `maybe_save` saves at steps that are multiples of this (and when forced).
      max_to_keep: number of most recent complete checkpoints kept; older ones are deleted.
      enable_async: write checkpoints on a background thread (`wait` blocks until done).

    All processes of a multi-host run call every method; Orbax writes each array shard once
    (from the process that owns it) and the JSON item and metadata from the primary process.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        period_steps: int,
        max_to_keep: int,
        enable_async: bool = True,
    ):
        if period_steps < 1:
            raise ValueError(f"checkpoint period_steps={period_steps}; must be >= 1")
        if max_to_keep < 1:
            raise ValueError(f"checkpoint max_to_keep={max_to_keep}; must be >= 1")
        path = os.fspath(directory)
        # Absolute, so that a later chdir cannot move the run; object-store URLs stay as given.
        self.directory = epath.Path(path if "://" in path else os.path.abspath(path))
        self.period_steps = period_steps
        self.max_to_keep = max_to_keep
        check_directory(self.directory)
        if jax.process_index() == 0:
            mark_directory(self.directory)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(n=max_to_keep),
            create=True,
            # Leftovers of saves killed midway are ours (`<step>.orbax-checkpoint-tmp*`).
            cleanup_tmp_directories=True,
            enable_async_checkpointing=enable_async,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=(STATE_ITEM, DATA_ITEM)
        )
        self._name_format = ocp.path.step.standard_name_format()

    def latest_step(self) -> int | None:
        """The step of the latest complete checkpoint on disk (None if there is none)."""
        meta = ocp.path.step.latest_step_metadata(self.directory, self._name_format)
        return None if meta is None else meta.step

    def reload(self) -> None:
        """Forget the steps seen on disk: after a step folder was moved away."""
        self._manager.reload()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, ascending."""
        return sorted(m.step for m in self._name_format.find_all(self.directory))

    def should_save(self, step: int, *, force: bool = False) -> bool:
        """Whether `maybe_save(step, ..., force=force)` writes a checkpoint."""
        if step in self._manager.all_steps():
            return False
        return force or step % self.period_steps == 0

    def maybe_save(
        self, step: int, state: PyTree, data_state: dict | None, *, force: bool = False
    ) -> bool:
        """Starts saving `state` and `data_state` as step `step` if due; returns whether it did.

        Due means `step % period_steps == 0` or `force` (use it for the last step), and no
        checkpoint of `step` exists yet. Returns once the arrays are copied off the devices (the
        caller may then donate or overwrite them); the files are written in the background.
        """
        if not self.should_save(step, force=force):
            return False
        data = {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "data_state": data_state}
        try:  # fail here, not later on the background thread
            json.dumps(data)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"checkpoint step {step}: data_state is not JSON-serializable: {e}"
            ) from e
        args = ocp.args.Composite(
            **{
                STATE_ITEM: ocp.args.StandardSave(_keys_to_data(state)),
                DATA_ITEM: ocp.args.JsonSave(data),
            }
        )
        return bool(self._manager.save(step, args=args, force=True))

    def restore(self, step: int, abstract_state: PyTree) -> tuple[PyTree, dict | None]:
        """Reads checkpoint `step` into the shardings of `abstract_state`.

        Args:
          step: a complete checkpoint's step (see `latest_step`).
          abstract_state: the train-state pytree with a `jax.ShapeDtypeStruct` (shape, dtype,
            sharding) per array; typed PRNG keys as key-dtype structs.

        Returns:
          `(state, data_state)`: the train state with the structure of `abstract_state`, and the
          data-iterator state given to `maybe_save`.
        """
        _check_abstract(abstract_state)
        if step not in self.all_steps():
            raise ValueError(
                f"no complete checkpoint of step {step} in {self.directory}; "
                f"complete steps: {self.all_steps()}"
            )
        rewrap: dict[int, Callable[[jax.Array], jax.Array]] = {}
        leaves, treedef = jax.tree.flatten(abstract_state)
        target = []
        for i, leaf in enumerate(leaves):
            if _is_key(leaf):
                data_leaf, impl = _abstract_key_data(leaf)
                rewrap[i] = functools.partial(_wrap_key_data, impl=impl)
                target.append(data_leaf)
            else:
                target.append(leaf)
        args = ocp.args.Composite(
            **{
                STATE_ITEM: ocp.args.StandardRestore(jax.tree.unflatten(treedef, target)),
                DATA_ITEM: ocp.args.JsonRestore(),
            }
        )
        restored = self._manager.restore(step, args=args)
        data = restored[DATA_ITEM]
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"checkpoint {self.directory} step {step}: not an expertax checkpoint")
        out, out_treedef = jax.tree.flatten(restored[STATE_ITEM])
        if not _same_structure(out_treedef, treedef):
            raise ValueError(
                f"checkpoint {self.directory} step {step}: restored structure {out_treedef} "
                f"differs from the target's {treedef}"
            )
        out = [rewrap[i](x) if i in rewrap else x for i, x in enumerate(out)]
        return jax.tree.unflatten(treedef, out), data["data_state"]

    def wait(self) -> None:
        """Blocks until the checkpoint being written (if any) is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's resources."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
