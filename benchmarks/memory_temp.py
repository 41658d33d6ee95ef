"""Compiled temp bytes of a mid-size config: before and after each seed-3922 reduction, per preset.

Run: `PYTHONPATH=src python benchmarks/memory_temp.py`; prints one JSON line per
compiled variant. "Before" variants are re-created here by patching the one function each
reduction lives in; nothing is allocated (abstract compile, 8 simulated CPU devices).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from expertax.nn import embed, norm  # noqa: E402
from expertax.preflight import load_config  # noqa: E402
from expertax.sharding import rules  # noqa: E402
from expertax.train.trainer import build_trainer  # noqa: E402

MID = [
    "model_name=deepseek3-tiny",
    "vocab_size=32768",
    "base_emb_dim=512",
    "base_num_query_heads=8",
    "base_num_kv_heads=8",
    "q_lora_rank=192",
    "kv_lora_rank=128",
    "qk_nope_head_dim=64",
    "qk_rope_head_dim=32",
    "v_head_dim=64",
    "base_mlp_dim=1536",
    "base_moe_mlp_dim=256",
    "base_num_decoder_layers=4",
    "num_experts=16",
    "num_experts_per_tok=4",
    "max_target_length=1024",
    "per_device_batch_size=2",
    "dtype=bfloat16",
]
FSDP = ["ici_fsdp_parallelism=8"]
TENSOR = ["ici_fsdp_parallelism=1", "ici_tensor_parallelism=8"]


def _all_modules_constrain(fn):
    """Point every module that imported `constrain` at fn; returns the undo list."""
    undo = []
    for mod in list(sys.modules.values()):
        if (
            getattr(mod, "__name__", "").startswith("expertax")
            and getattr(mod, "constrain", None) is rules.constrain
        ):
            undo.append((mod, mod.constrain))
            mod.constrain = fn
    return undo


@contextlib.contextmanager
def before_a():
    """Constraints emitted even for all-None specs."""

    def constrain(x, axes):
        r, mesh = rules.current_rules(), jax.sharding.get_abstract_mesh()
        if r is None or mesh.empty:
            return x
        return jax.lax.with_sharding_constraint(x, rules.logical_to_spec(axes, r, mesh, x.shape))

    undo = _all_modules_constrain(constrain)
    yield
    for mod, fn in undo:
        mod.constrain = fn


@contextlib.contextmanager
def before_b():
    """Mesh axes of size one kept in every spec."""
    original = rules.logical_to_spec

    def logical_to_spec(axes, r, mesh, shape=None):
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        used, spec = set(), []
        for i, name in enumerate(axes):
            kept = []
            for axis in () if name is None else r[name]:
                prod = sizes[axis]
                for k in kept:
                    prod *= sizes[k]
                if axis in used or (shape is not None and shape[i] % prod):
                    continue
                kept.append(axis)
                used.add(axis)
            spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
        return jax.sharding.PartitionSpec(*spec)

    rules.logical_to_spec = logical_to_spec
    yield
    rules.logical_to_spec = original


@contextlib.contextmanager
def before_c():
    """RMSNorm scale by einsum, offset always added."""
    original = norm.rms_norm

    def rms_norm(scale_D, x, eps, offset=0.0):
        x32 = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
        scale = scale_D.astype(jnp.float32) + jnp.float32(offset)
        return jnp.einsum("...d,d->...d", x32 * inv, scale).astype(x.dtype)

    norm.rms_norm = rms_norm
    yield
    norm.rms_norm = original


@contextlib.contextmanager
def before_d():
    """One-hot embedding whatever its size."""
    original = embed.ONE_HOT_LIMIT_BYTES
    embed.ONE_HOT_LIMIT_BYTES = float("inf")
    yield
    embed.ONE_HOT_LIMIT_BYTES = original


def measure(label: str, overrides: list[str], patch=contextlib.nullcontext) -> dict:
    c = load_config(overrides=[*MID, *overrides])
    t0 = time.perf_counter()
    with patch():
        ma = build_trainer(c).compile().memory_analysis()
    row = {
        "variant": label,
        "overrides": overrides,
        "temp_bytes": int(ma.temp_size_in_bytes),
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
        "compile_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    measure("after (fsdp=8)", FSDP)
    measure("after (tensor=8)", TENSOR)
    measure("(a) before (tensor=8)", TENSOR, before_a)
    measure("(b) before (fsdp=8)", FSDP, before_b)
    measure("(b) before (tensor=8)", TENSOR, before_b)
    measure("(c) before", FSDP, before_c)
    measure("(d) before: one-hot embed", [*FSDP, "use_iota_embed=true"], before_d)
    measure("(h) float32_weight_sum=false", [*FSDP, "float32_weight_sum=false"])
    for policy in ("none", "minimal", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj"):
        measure(f"remat_policy={policy}", [*FSDP, f"remat_policy={policy}"])
    measure(
        "remat_policy=custom moe_mlpwo=offload mlpwi_0=offload",
        [*FSDP, "remat_policy=custom", "moe_mlpwo=offload", "mlpwi_0=offload"],
    )


if __name__ == "__main__":
    main()
