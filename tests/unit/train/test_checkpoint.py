"""Checkpointer: bitwise round trips, mesh changes, retention, period, async, crash safety."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from expertax.train.checkpoint import (
    MARKER_FILE,
    Checkpointer,
    damage,
    first_readable,
    latest_intact_step,
)

AUTO = jax.sharding.AxisType.Auto


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    # Field order is deliberately not alphabetical: the restored order must follow the class.
    w_EDF: jax.Array
    norm_D: jax.Array
    embed_VD: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Params
    opt: dict
    step: jax.Array
    rng: jax.Array  # typed key, scalar
    rngs: jax.Array  # typed keys, shape [8]


def mesh_fsdp8():
    return jax.make_mesh((8,), ("fsdp",), axis_types=(AUTO,))


def mesh_ep4_fsdp2():
    return jax.make_mesh((4, 2), ("expert", "fsdp"), axis_types=(AUTO, AUTO))


def specs_fsdp8() -> TrainState:
    p = Params(w_EDF=P(None, "fsdp", None), norm_D=P(), embed_VD=P("fsdp", None))
    return TrainState(params=p, opt={"mu": p, "count": P()}, step=P(), rng=P(), rngs=P("fsdp"))


def specs_ep4_fsdp2() -> TrainState:
    p = Params(w_EDF=P("expert", "fsdp", None), norm_D=P(), embed_VD=P(("expert", "fsdp"), None))
    return TrainState(params=p, opt={"mu": p, "count": P()}, step=P(), rng=P(), rngs=P("expert"))


def make_state(seed: int, mesh=None) -> TrainState:
    """A train state with f32, bf16 and int arrays and typed PRNG keys, sharded over `mesh`."""
    k = jax.random.split(jax.random.key(seed), 4)
    params = Params(
        w_EDF=jax.random.normal(k[0], (8, 16, 4), jnp.float32),
        norm_D=jax.random.normal(k[1], (16,), jnp.bfloat16),
        embed_VD=jax.random.normal(k[2], (32, 16), jnp.bfloat16),
    )
    mu = jax.tree.map(lambda x: x * 0.5, params)
    state = TrainState(
        params=params,
        opt={"mu": mu, "count": jnp.int32(7 + seed)},
        step=jnp.int32(100 + seed),
        rng=k[3],
        rngs=jax.random.split(jax.random.key(seed + 1000), 8),
    )
    mesh = mesh or mesh_fsdp8()
    return jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs_fsdp8()))


def abstract(state, shardings):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


def named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def bits(x) -> tuple[str, tuple[int, ...], bytes]:
    """dtype, shape and raw bytes of an array (typed keys through their key data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return (f"{x.dtype}", x.shape, np.asarray(jax.random.key_data(x)).tobytes())
    return (f"{x.dtype}", x.shape, np.asarray(x).tobytes())


def assert_bitwise(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert bits(x) == bits(y)


def assert_sharded_as(state, target) -> None:
    for x, t in zip(jax.tree.leaves(state), jax.tree.leaves(target), strict=True):
        assert x.sharding.is_equivalent_to(t.sharding, x.ndim), (x.sharding, t.sharding)


def test_round_trip_bitwise(tmp_path):
    state, other = make_state(0), make_state(1)
    assert bits(state.params.w_EDF) != bits(other.params.w_EDF)  # negative control
    data = {"position": 12, "shard": [0, 3], "name": "synthetic", "nested": {"seed": 5}}
    with Checkpointer(tmp_path, period_steps=2, max_to_keep=3) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.maybe_save(2, state, data)
        assert ckpt.maybe_save(4, other, None)
        ckpt.wait()
        assert ckpt.latest_step() == 4
        target = abstract(state, jax.tree.map(lambda x: x.sharding, state))
        restored, restored_data = ckpt.restore(2, target)
        restored_other, other_data = ckpt.restore(4, target)
    assert isinstance(restored, TrainState) and isinstance(restored.params, Params)
    assert_bitwise(restored, state)
    assert_bitwise(restored_other, other)
    assert restored.params.norm_D.dtype == jnp.bfloat16 and restored.step.dtype == jnp.int32
    assert jax.random.key_impl(restored.rng) == jax.random.key_impl(state.rng)
    assert restored_data == data and other_data is None
    assert_sharded_as(restored, target)
    # Restored keys are usable keys that draw the same numbers.
    np.testing.assert_array_equal(
        jax.random.normal(restored.rng, (3,)), jax.random.normal(state.rng, (3,))
    )


@pytest.mark.distributed
def test_restore_on_other_meshes_bitwise(tmp_path):
    state = make_state(3)
    with Checkpointer(tmp_path, period_steps=1, max_to_keep=1) as ckpt:
        ckpt.maybe_save(5, state, {"position": 5})
    ckpt = Checkpointer(tmp_path, period_steps=1, max_to_keep=1)  # a new process, in effect
    assert ckpt.latest_step() == 5
    ep_target = abstract(state, named(mesh_ep4_fsdp2(), specs_ep4_fsdp2()))
    on_ep, data = ckpt.restore(5, ep_target)
    assert_bitwise(on_ep, state)
    assert_sharded_as(on_ep, ep_target)
    assert on_ep.params.w_EDF.sharding.spec == P("expert", "fsdp", None)
    rng_shards = on_ep.rngs.addressable_shards
    assert len(rng_shards) == 8 and rng_shards[0].data.shape == (2,)
    one = SingleDeviceSharding(jax.devices()[3])
    one_target = abstract(state, jax.tree.map(lambda _: one, state))
    on_one, _ = ckpt.restore(5, one_target)
    assert_bitwise(on_one, state)
    assert all(x.devices() == {jax.devices()[3]} for x in jax.tree.leaves(on_one))
    assert data == {"position": 5}
    ckpt.close()


def test_max_to_keep(tmp_path):
    (tmp_path / "run").mkdir()
    state = make_state(0)
    with Checkpointer(tmp_path / "run", period_steps=1, max_to_keep=2) as ckpt:
        (tmp_path / "run" / "notes.txt").write_text("mine")  # user data next to checkpoints
        for step in range(1, 6):
            assert ckpt.maybe_save(step, state, {"position": step})
        ckpt.wait()
        assert ckpt.all_steps() == [4, 5]
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == ["4", "5", MARKER_FILE, "notes.txt"]
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_period_and_force(tmp_path):
    state = make_state(0)
    with Checkpointer(tmp_path, period_steps=3, max_to_keep=10) as ckpt:
        saved = [s for s in range(1, 8) if ckpt.maybe_save(s, state, None)]
        assert saved == [3, 6]
        assert ckpt.maybe_save(7, state, None, force=True)  # the last step of a run
        assert not ckpt.maybe_save(6, state, None, force=True)  # exists already
        ckpt.wait()
        assert ckpt.all_steps() == [3, 6, 7]


def test_async_save_then_wait(tmp_path):
    state = make_state(0)
    expected = jax.tree.map(bits, state)
    target = abstract(state, jax.tree.map(lambda x: x.sharding, state))
    with Checkpointer(tmp_path, period_steps=1, max_to_keep=2, enable_async=True) as ckpt:
        assert ckpt.maybe_save(1, state, {"position": 1})
        # The save copied the arrays off the devices: the caller may free (donate) them now.
        for x in jax.tree.leaves(state):
            x.delete()
        ckpt.wait()
        assert ckpt.latest_step() == 1
        restored, data = ckpt.restore(1, target)
    assert jax.tree.map(bits, restored) == expected
    assert data == {"position": 1}


def test_killed_during_save_resumes_from_previous(tmp_path):
    directory = tmp_path / "run"
    child = Path(__file__).with_name("_ckpt_kill_child.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env["XLA_FLAGS"] = ""
    proc = subprocess.run(
        [sys.executable, str(child), str(directory)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    names = os.listdir(directory)
    assert "1" in names and "2" not in names
    assert any(n.startswith("2.") and "orbax-checkpoint-tmp" in n for n in names), names
    ckpt = Checkpointer(directory, period_steps=1, max_to_keep=3)
    assert ckpt.latest_step() == 1
    one = SingleDeviceSharding(jax.devices()[0])
    target = {
        "w": jax.ShapeDtypeStruct((1 << 24,), jnp.float32, sharding=one),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=one),
    }
    restored, data = ckpt.restore(1, target)
    assert int(restored["step"]) == 1 and data == {"position": 1}
    assert float(restored["w"].min()) == float(restored["w"].max()) == 1.0
    # The resumed run saves step 2 again; the leftover of the killed save is gone.
    assert ckpt.maybe_save(2, {"w": restored["w"] + 1, "step": jnp.int32(2)}, {"position": 2})
    ckpt.close()
    assert sorted(os.listdir(directory)) == ["1", "2", MARKER_FILE]


def test_latest_step_ignores_incomplete(tmp_path):
    state = make_state(0)
    target = abstract(state, jax.tree.map(lambda x: x.sharding, state))
    with Checkpointer(tmp_path, period_steps=1, max_to_keep=5) as ckpt:
        ckpt.maybe_save(1, state, None)
        ckpt.maybe_save(2, state, None)
        ckpt.wait()
        partial = tmp_path / "3.orbax-checkpoint-tmp"  # what a killed save leaves
        (partial / "state").mkdir(parents=True)
        (partial / "state" / "junk").write_bytes(b"\0" * 10)
        assert ckpt.latest_step() == 2
        assert ckpt.all_steps() == [1, 2]
        with pytest.raises(ValueError, match="no complete checkpoint of step 3"):
            ckpt.restore(3, target)


def test_rejects_foreign_directory(tmp_path):
    (tmp_path / "data.bin").write_bytes(b"precious")
    with pytest.raises(ValueError, match=str(tmp_path)):
        Checkpointer(tmp_path, period_steps=1, max_to_keep=1)
    assert (tmp_path / "data.bin").read_bytes() == b"precious"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        Checkpointer(tmp_path / "afile", period_steps=1, max_to_keep=1)
    empty = tmp_path / "empty"
    empty.mkdir()
    Checkpointer(empty, period_steps=1, max_to_keep=1).close()  # an empty directory is fine
    assert (empty / MARKER_FILE).exists()


def test_restore_target_needs_shardings(tmp_path):
    state = {"w": jnp.ones((4,), jnp.float32)}
    with Checkpointer(tmp_path, period_steps=1, max_to_keep=1) as ckpt:
        ckpt.maybe_save(1, state, None)
        ckpt.wait()
        with pytest.raises(ValueError, match=r"\['w'\] has no sharding"):
            ckpt.restore(1, {"w": jax.ShapeDtypeStruct((4,), jnp.float32)})


@pytest.mark.parametrize(
    "bad", [dict(period_steps=0, max_to_keep=1), dict(period_steps=1, max_to_keep=0)]
)
def test_rejects_bad_settings(tmp_path, bad):
    with pytest.raises(ValueError, match="must be >= 1"):
        Checkpointer(tmp_path, **bad)


def test_data_state_must_be_json(tmp_path):
    with Checkpointer(tmp_path, period_steps=1, max_to_keep=1) as ckpt:
        with pytest.raises(ValueError, match="not JSON-serializable"):
            ckpt.maybe_save(1, {"w": jnp.ones((2,))}, {"position": object()})
        assert ckpt.latest_step() is None


def test_a_step_with_missing_files_is_damaged_and_skipped(tmp_path):
    """`latest_intact_step` passes over complete-looking steps that lack a file a save writes;
    negative control: the intact steps are not named."""
    with Checkpointer(tmp_path, period_steps=1, max_to_keep=5) as ckpt:
        for step in (1, 2, 3):
            ckpt.maybe_save(step, {"w": jnp.full((4,), step, jnp.float32)}, {"position": step})
        ckpt.wait()
    assert latest_intact_step(tmp_path) == (3, {}) and damage(tmp_path, 3) is None
    (tmp_path / "3" / "state" / "_METADATA").unlink()
    (tmp_path / "2" / "data" / "metadata").write_bytes(b"")
    step, damaged = latest_intact_step(tmp_path)
    assert step == 1 and sorted(damaged) == [2, 3]
    assert "state/_METADATA" in damaged[3] and "data/metadata" in damaged[2]
    # every file the check knows of, and the arrays' data of the OCDBT store, one at a time
    state = tmp_path / "1" / "state"
    stores = [f"state/{p.name}/manifest.ocdbt" for p in state.glob("ocdbt.process_*")]
    for gone in ["_CHECKPOINT_METADATA", "data/metadata", "state/manifest.ocdbt", *stores]:
        (tmp_path / "1" / gone).rename(tmp_path / "aside")
        assert gone in (damage(tmp_path, 1) or ""), gone
        (tmp_path / "aside").rename(tmp_path / "1" / gone)
    assert damage(tmp_path, 1) is None
    for data in state.glob("ocdbt.process_*/d"):
        shutil.rmtree(data)
    assert "ocdbt.process_*/d" in (damage(tmp_path, 1) or "")


def cut_array_chunks(step_dir: Path) -> int:
    """Cut every file of the OCDBT stores' data folders of a saved step's state (the arrays'
    chunks, the small ones inline in the b-tree nodes) to half its length, as a disk or a copy
    cut short leaves them: every file is there and none is empty, so `damage` sees nothing.
    Returns how many files were cut."""
    files = [f for f in (step_dir / "state").glob("**/d/*") if f.is_file()]
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return len(files)


def test_a_step_whose_array_chunks_are_cut_short_is_passed_over_when_read(tmp_path):
    """`first_readable` reads the newest step it can: a step with cut array chunks (which the file
    check cannot see) is named with its error, in one line; negative control: intact steps read
    first time, and none that reads is (None, None, every step's error)."""
    sharding = SingleDeviceSharding(jax.devices()[0])
    abstract = {"w": jax.ShapeDtypeStruct((4096,), jnp.float32, sharding=sharding)}
    with Checkpointer(tmp_path, period_steps=1, max_to_keep=5) as ckpt:
        for step in (1, 2, 3):
            w = jax.random.normal(jax.random.key(step), (4096,), jnp.float32)
            ckpt.maybe_save(step, {"w": w}, {"position": step})
        ckpt.wait()
        read = lambda step: ckpt.restore(step, abstract)  # noqa: E731
        step, _, unreadable = first_readable(tmp_path, [3, 2, 1], read)
        assert (step, unreadable) == (3, {})
        assert cut_array_chunks(tmp_path / "3") > 0
        assert latest_intact_step(tmp_path) == (3, {})  # the files are all there
        step, (state, data), unreadable = first_readable(tmp_path, [3, 2, 1], read)
        assert step == 2 and data == {"position": 2} and list(unreadable) == [3]
        want = jax.random.normal(jax.random.key(2), (4096,), jnp.float32)
        np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(want))
        assert "\n" not in unreadable[3] and len(unreadable[3]) < 300, unreadable[3]
        cut_array_chunks(tmp_path / "2")
        cut_array_chunks(tmp_path / "1")
        step, value, unreadable = first_readable(tmp_path, [3, 2, 1], read)
        assert (step, value, sorted(unreadable)) == (None, None, [1, 2, 3])


def test_what_a_failed_read_leaves_behind_is_dropped_and_nothing_else(monkeypatch):
    """After a failed read of a directory: asyncio's records of its futures' errors (a plain
    Future's or a _GatheringFuture's) and the errors of its read coroutines collected at exit are
    dropped when they name the directory; a record or an error that does not is kept."""
    import logging
    import types

    from expertax.train import checkpoint

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    monkeypatch.setattr(checkpoint, "_QUIET_IN", set())
    record = lambda text: logging.LogRecord("asyncio", logging.ERROR, "", 0, text, None, None)
    with checkpoint._quiet_failed_reads("/runs/r/checkpoints") as failed:
        failed()
    for first in ("Future", "_GatheringFuture", "Task"):
        text = f"{first} exception was never retrieved\nfuture: ... '/runs/r/checkpoints/2/state/'"
        assert not checkpoint._not_a_failed_read(record(text))
    assert checkpoint._not_a_failed_read(record("Future exception was never retrieved\n/other"))
    assert checkpoint._not_a_failed_read(record("something else /runs/r/checkpoints"))
    error = Exception("reading index: TensorStore({'path': '/runs/r/checkpoints/2/state/'})")
    sys.unraisablehook(types.SimpleNamespace(exc_value=error))
    other = types.SimpleNamespace(exc_value=Exception("another error"))
    sys.unraisablehook(other)
    assert seen == [other]
