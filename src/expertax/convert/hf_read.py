"""HF checkpoint -> expertax parameters, streamed: one tensor (or block of rows) at a time.

`plan` reads only the safetensors headers: it maps every tensor to a slice of a leaf
(`hf.tensor_map`), checks shapes and dtypes, decides each leaf's stored dtype (fp8 weights
become the config's weight_dtype, as do GPT-OSS's MXFP4 experts, read in units of whole
experts: mxfp4.py) and its chunk layout, and cuts tensors larger than a chunk into blocks of
rows (the embedding and lm_head of DeepSeek-V3 are 1.8 GiB each). `run` then
converts the units on worker threads (numpy, safetensors and tensorstore release the GIL for
their copies), each unit read -> dequantized -> transformed -> written -> released, so the
memory held is a few units, never a leaf or the model.

The multi-token-prediction layers' copies of the embedding and output head (`TensorMap.shared`)
are not written: `check_shared` compares them with the main tensors, block by block, before
anything is written, and refuses a checkpoint whose copies differ.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Collection
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import ml_dtypes
import numpy as np

from expertax.config import Config
from expertax.convert import fp8, hf_gpt_oss, mxfp4
from expertax.convert.errors import ConversionError, ShapeError
from expertax.convert.hf import TensorMap, hf_shape, leaf_specs, tensor_map, to_ours, transpose
from expertax.convert.hf_config import config_from_hf
from expertax.convert.safetensors_io import Reader
from expertax.errors import ConfigError

CHUNK_BYTES = 64 * 2**20  # a tensor larger than this (as stored) is converted in row blocks
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One piece of work: HF tensor `name` (rows [a, b) when `rows`) into its leaf slice."""

    name: str
    t: TensorMap | None  # None: a fused expert tensor (a whole layer's experts)
    rows: tuple[int, int] | None
    nbytes: int  # bytes read from the checkpoint

    @property
    def key(self) -> str:
        return self.name if self.rows is None else f"{self.name}@{self.rows[0]}:{self.rows[1]}"


@dataclasses.dataclass
class Plan:
    c: Config
    hf: dict
    units: list[Unit]
    layouts: dict[str, tuple[tuple[int, ...], np.dtype, tuple[int, ...]]]  # shape, dtype, chunks
    checks: list[tuple[Unit, str]]  # (a shared copy's unit, the main tensor it must equal)
    fp8: bool
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)


def _maps(c: Config, hf: dict) -> tuple[list[TensorMap], dict[str, TensorMap]]:
    interleave = bool(hf.get("rope_interleave", True)) and c.attention_type == "mla"
    canonical = tensor_map(c, interleave=interleave)
    maps = {t.hf_name: t for t in canonical}
    if c.decoder_block == "mixtral":  # transformers >= 5 names the router mlp.gate
        for t in canonical:
            if t.hf_name.endswith("block_sparse_moe.gate.weight"):
                alias = t.hf_name.replace("block_sparse_moe.gate", "mlp.gate")
                maps[alias] = dataclasses.replace(t, hf_name=alias)
    return canonical, maps


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ShapeError(f"tensor {name} has shape {tuple(got)}; the config implies {want}")


def _fused_targets(c: Config, name: str) -> tuple[str, int, str, tuple[int, ...]]:
    """(MoE leaf prefix, layer index into it, gate_up_proj or down_proj (with `_bias`), HF
    shape). The layout is the model type's, never guessed from the shape (GPT-OSS's
    [E, D, 2F] and transformers' Mixtral / Qwen3-MoE [E, 2F, D] are one shape when 2F = D)."""
    match = _FUSED.match(name)
    assert match is not None, name  # callers pass fused names only
    layer, which = int(match.group(1)), match.group(2) + (match.group(3) or "")
    gpt_oss = c.decoder_block == "gpt_oss"
    if which.endswith("_bias") and not gpt_oss:
        raise ConversionError(
            f"tensor {name}: expert biases are GPT-OSS's; decoder_block={c.decoder_block!r} "
            "has none"
        )
    m, i = "moe_layers.moe", layer - c.num_dense_layers
    if layer >= c.base_num_decoder_layers:  # a multi-token-prediction module's block
        m, i = "mtp.block.moe", layer - c.base_num_decoder_layers
    if i < 0:
        raise ConversionError(f"tensor {name}: layer {layer} is a dense layer in the config")
    e, d, f = c.num_experts, c.base_emb_dim, c.base_moe_mlp_dim
    if gpt_oss:
        return m, i, which, hf_gpt_oss.fused_shapes(c)[which]
    return m, i, which, (e, 2 * f, d) if which == "gate_up_proj" else (e, d, f)


_FUSED_LEAVES = hf_gpt_oss.FUSED_LEAVES  # the same leaves for every fused layout


def _layer(name: str) -> int | None:
    match = _LAYER.match(name)
    return None if match is None else int(match.group(1))


def _config(hf: dict, names: set[str]) -> tuple[Config, list[str]]:
    """The checkpoint's Config, and notes. A config.json that declares multi-token-prediction
    layers for a checkpoint holding none of their tensors (transformers' `save_pretrained`
    writes `num_nextn_predict_layers` but drops the layers) converts without them."""
    c = config_from_hf(hf)
    first = c.base_num_decoder_layers
    if not c.mtp_num_layers or any((_layer(n) or 0) >= first for n in names):
        return c, []
    last = first + c.mtp_num_layers - 1
    layers = f"layer {first}" if last == first else f"layers {first}..{last}"
    note = (
        f"config.json has num_nextn_predict_layers={c.mtp_num_layers} but the checkpoint holds "
        f"no tensor of its {layers}: converted without multi-token prediction (mtp_num_layers=0)"
    )
    return config_from_hf({**hf, "num_nextn_predict_layers": 0}), [note]


def _no_place(c: Config, name: str, directory) -> ConversionError:
    layer, n = _layer(name), c.base_num_decoder_layers + c.mtp_num_layers
    if layer is not None and layer >= n:
        return ConversionError(
            f"tensor {name} in {directory} belongs to layer {layer}; the config has "
            f"num_hidden_layers={c.base_num_decoder_layers} and num_nextn_predict_layers="
            f"{c.mtp_num_layers} (layers 0..{n - 1})"
        )
    return ConversionError(f"tensor {name} in {directory} has no place in the model")


SHARES = (
    "expertax shares the embedding and the output head between the main model and its "
    "multi-token-prediction layers"
)


def _split_rows(t: TensorMap, slice_shape: tuple[int, ...], itemsize: int) -> int | None:
    """Rows per block when a tensor of this map is converted in row blocks, else None: 2-D
    slices without RoPE columns larger than CHUNK_BYTES, in multiples of 128 (fp8 blocks)."""
    if len(slice_shape) != 2 or t.rope is not None or t.kind == "flat":
        return None
    hf_rows, hf_cols = hf_shape(t, slice_shape)
    if hf_rows * hf_cols * itemsize <= CHUNK_BYTES:
        return None
    return max(fp8.BLOCK, CHUNK_BYTES // (hf_cols * itemsize) // fp8.BLOCK * fp8.BLOCK)


def plan(reader: Reader, hf: dict) -> Plan:
    """Every unit of work of converting `reader`'s checkpoint, from its headers only."""
    names = set(reader.names())
    c, notes = _config(hf, names)
    fmt = mxfp4.quantization_format(hf.get("quantization_config"))
    quantized = fmt == "fp8"
    canonical, maps = _maps(c, hf)
    specs = leaf_specs(c)
    depth = {t.leaf: len(t.index) for t in canonical}
    dtypes: dict[str, tuple[np.dtype, str]] = {}
    filled: set[tuple[str, tuple[int, ...]]] = set()
    units, shared, blocks = [], [], {}

    def stored_dtype(dtype: np.dtype, name: str) -> np.dtype:
        """The dtype a tensor is converted into: fp8 is dequantized to weight_dtype."""
        if dtype != fp8.FP8:
            return dtype
        if not quantized:
            raise ConversionError(f"tensor {name} is fp8 but config.json lacks quantization_config")
        return _np_dtype(c.weight_dtype)

    def leaf_dtype(leaf: str, dtype: np.dtype, name: str) -> None:
        dtype = stored_dtype(dtype, name)
        old = dtypes.setdefault(leaf, (dtype, name))
        if old[0] != dtype:
            raise ConversionError(
                f"tensor {name} has dtype {dtype}, tensor {old[1]} of the same leaf {leaf} {old[0]}"
            )

    for name in sorted(names):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if (
            quantized
            and name.endswith(fp8.SCALE_SUFFIX)
            and name[: -len(fp8.SCALE_SUFFIX)] in names
        ):
            continue  # read with its weight
        if name.endswith(mxfp4.SCALES) and _base(name, mxfp4.SCALES) + mxfp4.BLOCKS in names:
            continue  # read with its blocks
        if name.endswith(mxfp4.BLOCKS) and c.is_moe:
            m, i, which, mx_units = _mxfp4_units(reader, c, name, fmt)
            for leaf in _FUSED_LEAVES[which]:
                depth[f"{m}.{leaf}"] = 2
                leaf_dtype(f"{m}.{leaf}", _np_dtype(c.weight_dtype), name)
                filled.update((f"{m}.{leaf}", (i, j)) for j in range(c.num_experts))
            units += mx_units
            continue
        dtype, shape = reader.dtype(name), reader.shape(name)
        if dtype == fp8.FP8 and fp8.scale_name(name) not in names:
            raise ConversionError(f"fp8 tensor {name} has no {fp8.scale_name(name)}")
        if _FUSED.match(name) and c.is_moe:
            if dtype == fp8.FP8:
                raise ConversionError(f"fused expert tensor {name} in fp8 is not supported")
            m, i, which, want = _fused_targets(c, name)
            _check_shape(name, shape, want)
            for leaf in _FUSED_LEAVES[which]:
                depth[f"{m}.{leaf}"] = 2
                leaf_dtype(f"{m}.{leaf}", dtype, name)
                filled.update((f"{m}.{leaf}", (i, j)) for j in range(c.num_experts))
            units += _expert_units(name, shape, dtype)
            continue
        t = maps.get(name)
        if t is None:
            raise _no_place(c, name, reader.directory)
        slice_shape = specs[t.leaf].shape[len(t.index) :]
        _check_shape(name, shape, hf_shape(t, slice_shape))
        if t.shared:  # checked against the main tensor once every dtype is known
            shared.append((t, name, stored_dtype(dtype, name), shape, dtype))
            continue
        leaf_dtype(t.leaf, dtype, name)
        filled.add((t.leaf, t.index))
        rows = _split_rows(t, slice_shape, dtypes[t.leaf][0].itemsize)
        if rows is None:
            units.append(Unit(name, t, None, reader_nbytes(shape, dtype)))
            continue
        blocks[t.leaf] = rows
        for a in range(0, shape[0], rows):
            b = min(a + rows, shape[0])
            units.append(Unit(name, t, (a, b), reader_nbytes((b - a, shape[1]), dtype)))
    missing = [t.hf_name for t in canonical if not t.shared and (t.leaf, t.index) not in filled]
    if missing:
        raise ConversionError(
            f"{reader.directory} lacks tensors {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    unfilled = sorted(set(specs) - set(depth))
    if unfilled:
        raise ConversionError(f"{reader.directory} lacks the tensors of {', '.join(unfilled)}")
    layouts = {}
    for leaf, spec in specs.items():
        k = depth[leaf]
        chunks = [1] * k + list(spec.shape[k:])
        if leaf in blocks:  # copy (embed): rows of ours; linear (lm_head): columns of ours
            copy = any(t.kind == "copy" for t in canonical if t.leaf == leaf and not t.shared)
            chunks[k if copy else k + 1] = blocks[leaf]
        layouts[leaf] = (tuple(spec.shape), dtypes[leaf][0], tuple(chunks))
    checks = _check_units(canonical, shared, specs, dtypes)
    return Plan(c, hf, units, layouts, checks, quantized, notes)


def _expert_units(name: str, shape: tuple[int, ...], dtype: np.dtype) -> list[Unit]:
    """A fused expert tensor [E, ...] as one unit, or as units of whole experts when larger
    than CHUNK_BYTES (gpt-oss-20b's gate_up_proj: 1 GiB a layer in bfloat16)."""
    e, per_expert = shape[0], reader_nbytes(shape[1:], dtype)
    step = max(1, CHUNK_BYTES // per_expert)
    if step >= e:
        return [Unit(name, None, None, e * per_expert)]
    return [Unit(name, None, (a, min(a + step, e)), (min(a + step, e) - a) * per_expert)
            for a in range(0, e, step)]  # fmt: skip


def _base(name: str, suffix: str) -> str:
    return name[: -len(suffix)]


def _mxfp4_units(reader: Reader, c: Config, name: str, fmt: str):
    """(MoE leaf prefix, layer index, gate_up_proj or down_proj, units) of a GPT-OSS expert
    weight stored in MXFP4 (`name` its `_blocks`): units of whole experts, each at most
    CHUNK_BYTES once dequantized."""
    base = _base(name, mxfp4.BLOCKS)
    match = _FUSED.match(base)
    if match is None or match.group(3) or c.decoder_block != "gpt_oss":
        raise ConversionError(
            f"tensor {name}: MXFP4 is read for GPT-OSS's fused expert weights "
            "(model.layers.<i>.mlp.experts.gate_up_proj / down_proj) only"
        )
    if fmt != mxfp4.QUANT_METHOD:
        raise ConversionError(
            f"tensor {name} is MXFP4 but config.json's quantization_config does not declare "
            f"quant_method='mxfp4' (it has {fmt or 'none'})"
        )
    scales = _base(name, mxfp4.BLOCKS) + mxfp4.SCALES
    if scales not in reader.names():
        raise ConversionError(f"MXFP4 tensor {name} has no {scales}")
    m, i, which, (e, a, b) = _fused_targets(c, base)
    want_blocks, want_scales = mxfp4.stored_shapes((e, b, a), base)  # stored as [E, out, in]
    for n, want in ((name, want_blocks), (scales, want_scales)):
        _check_shape(n, reader.shape(n), want)
        if reader.dtype(n) != np.uint8:
            raise ConversionError(f"MXFP4 tensor {n} has dtype {reader.dtype(n)}; needs uint8")
    per_expert = a * b * _np_dtype(c.weight_dtype).itemsize
    step = max(1, CHUNK_BYTES // per_expert)
    units = [
        Unit(name, None, (j, min(j + step, e)), reader_nbytes(
            (min(j + step, e) - j, *want_blocks[1:]), np.dtype(np.uint8)) * 17 // 16)
        for j in range(0, e, step)
    ]  # fmt: skip
    return m, i, which, units


def _check_units(canonical: list[TensorMap], shared: list, specs, dtypes) -> list[tuple[Unit, str]]:
    """(unit, main tensor) comparing each shared copy with the main tensor, in row blocks as
    the main tensor is read; a copy of another dtype is refused here. An absent copy is not
    needed (expertax holds the tensor once) and not checked."""
    mains = {(t.leaf, t.index): t.hf_name for t in canonical if not t.shared}
    out = []
    for t, name, dtype, shape, raw in shared:
        main, (main_dtype, _) = mains[t.leaf, t.index], dtypes[t.leaf]
        if dtype != main_dtype:
            raise ConversionError(
                f"tensor {name} has dtype {dtype}, {main} {main_dtype}: {SHARES}, so the copies "
                "must be equal bit for bit"
            )
        rows = _split_rows(t, specs[t.leaf].shape[len(t.index) :], dtype.itemsize)
        if rows is None:
            out.append((Unit(name, t, None, reader_nbytes(shape, raw)), main))
            continue
        for a in range(0, shape[0], rows):
            b = min(a + rows, shape[0])
            out.append((Unit(name, t, (a, b), reader_nbytes((b - a, shape[1]), raw)), main))
    return out


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def reader_nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _read(reader: Reader, p: Plan, u: Unit, dtype: np.dtype) -> np.ndarray:
    """The unit's rows of its HF tensor, fp8 dequantized into `dtype`."""
    w = reader.get(u.name, u.rows)
    if w.dtype != fp8.FP8:
        return w
    grid = reader.get(fp8.scale_name(u.name))
    if u.rows is not None:
        grid = grid[u.rows[0] // fp8.BLOCK : -(-u.rows[1] // fp8.BLOCK)]
    return fp8.dequantize(w, grid, dtype)


Write = Callable[[str, tuple, np.ndarray], None]  # (leaf, where, value)


def _run_mxfp4(reader: Reader, p: Plan, u: Unit, write: Write) -> None:
    """Experts [a, b) of an MXFP4 weight, dequantized straight into our leaves' [D, F] / [F, D]
    layout (gate_up_proj's rows interleave gate and up: gate = rows 0::2, up = rows 1::2)."""
    assert u.rows is not None, u.name  # MXFP4 units are ranges of experts
    base = _base(u.name, mxfp4.BLOCKS)
    m, i, which, _ = _fused_targets(p.c, base)
    blocks, scales = reader.get(u.name, u.rows), reader.get(base + mxfp4.SCALES, u.rows)
    dtype = p.layouts[f"{m}.wo"][1]
    if which == "gate_up_proj":
        for leaf, rows in ((f"{m}.wi_0", slice(0, None, 2)), (f"{m}.wi_1", slice(1, None, 2))):
            w = mxfp4.dequantize_transposed(blocks[:, rows], scales[:, rows], dtype, base)
            for j, w_DF in enumerate(w, start=u.rows[0]):
                write(leaf, (i, j), w_DF)
    else:
        w = mxfp4.dequantize_transposed(blocks, scales, dtype, base)
        for j, w_FD in enumerate(w, start=u.rows[0]):
            write(f"{m}.wo", (i, j), w_FD)


def run_unit(reader: Reader, p: Plan, u: Unit, write: Write) -> None:
    if u.name.endswith(mxfp4.BLOCKS):
        _run_mxfp4(reader, p, u, write)
        return
    if u.t is None:  # fused: a layer's gate_up_proj and down_proj (or experts [a, b) of them)
        m, i, which, _ = _fused_targets(p.c, u.name)
        w = _read(reader, p, u, p.layouts[f"{m}.wo"][1])
        f, at = p.c.base_moe_mlp_dim, (i, slice(*(u.rows or (None,))))  # the unit's experts
        if p.c.decoder_block == "gpt_oss":
            for leaf, x in hf_gpt_oss.split_fused(which, w).items():
                write(f"{m}.{leaf}", at, x)
        elif which == "gate_up_proj":
            write(f"{m}.wi_0", at, np.stack([transpose(x[:f]) for x in w]))
            write(f"{m}.wi_1", at, np.stack([transpose(x[f:]) for x in w]))
        else:
            write(f"{m}.wo", at, np.stack([transpose(x) for x in w]))
        return
    t = u.t
    shape, dtype, _ = p.layouts[t.leaf]
    w = _read(reader, p, u, dtype)
    if u.rows is None:
        write(t.leaf, t.index, to_ours(t, w, shape[len(t.index) :]))
        return
    rows = slice(*u.rows)
    if t.kind == "copy":
        write(t.leaf, (*t.index, rows), w)
    else:
        write(t.leaf, (*t.index, slice(None), rows), transpose(w))


def check_unit(reader: Reader, p: Plan, u: Unit, main: str) -> None:
    """Refuse (ConversionError) when a shared copy's rows differ from the main tensor's, both
    read as they are converted (fp8 dequantized into the leaf's dtype)."""
    assert u.t is not None, u.name  # a shared copy always has its map
    dtype = p.layouts[u.t.leaf][1]
    copy = _read(reader, p, u, dtype)
    want = _read(reader, p, dataclasses.replace(u, name=main), dtype)
    bits = f"u{copy.dtype.itemsize}"
    differ = copy.view(bits) != want.view(bits)
    if not differ.any():
        return
    where = tuple(int(x) for x in np.argwhere(differ)[0])
    at = (where[0] + u.rows[0], *where[1:]) if u.rows is not None else where
    rows = "" if u.rows is None else f" in rows {u.rows[0]}..{u.rows[1] - 1}"
    raise ConversionError(
        f"tensor {u.name} differs from {main}: {int(differ.sum())} of {differ.size} values"
        f"{rows}, the first at {list(at)} ({copy[where]} vs {want[where]}); {SHARES}, so it "
        "cannot hold different copies"
    )


def check_shared(reader: Reader, p: Plan, *, workers: int = 2) -> None:
    """Compare every shared copy with its main tensor (`Plan.checks`), before anything is
    written; ConversionError naming the first copy that differs."""
    _each([(check_unit, (reader, p, u, main)) for u, main in p.checks], workers=workers)


def run(
    reader: Reader,
    p: Plan,
    write: Write,
    *,
    done: Collection[str] = frozenset(),
    on_done: Callable[[Unit], None] = lambda u: None,
    workers: int = 2,
) -> int:
    """Convert the units not in `done` on `workers` threads; `on_done(unit)` runs on this
    thread after each unit's bytes are written. At most 2 x workers units are in flight."""
    todo = [u for u in p.units if u.key not in done]
    _each(
        [(run_unit, (reader, p, u, write)) for u in todo],
        on_done=lambda args: on_done(args[2]),
        workers=workers,
    )
    return len(todo)


def _each(calls: list[tuple[Callable, tuple]], *, on_done=lambda args: None, workers: int) -> None:
    """`fn(*args)` for each call, on `workers` threads (at most 2 x workers in flight);
    `on_done(args)` on this thread after each. The first exception cancels the rest."""
    if workers <= 1:
        for fn, args in calls:
            fn(*args)
            on_done(args)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="convert") as pool:
        pending: dict = {}
        queue = iter(calls)
        try:
            while True:
                while len(pending) < 2 * workers:
                    nxt = next(queue, None)
                    if nxt is None:
                        break
                    pending[pool.submit(nxt[0], *nxt[1])] = nxt[1]
                if not pending:
                    break
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    fut.result()
                    on_done(pending.pop(fut))
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():  # a file, or nothing there
        raise FileNotFoundError(f"{hf_dir} is no folder; give a HuggingFace model folder")
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json")
    try:
        hf = json.loads(path.read_text())
    except ValueError as e:  # not UTF-8, or not JSON
        raise ConfigError(f"{path} is damaged (not JSON: {e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} is not an HF config (a {type(hf).__name__}, not an object)")
    return hf
