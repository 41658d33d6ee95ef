"""Tiny hub-format DeepSeek-V3 checkpoints for the conversion tests, without torch: bfloat16,
and fp8 as DeepSeek publishes it (quantized by the reference recipe below, not by our code), with
one multi-token-prediction layer."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

import expertax
from expertax.convert import write_hf
from expertax.convert.safetensors_io import iter_tensors
from expertax.models import decoder
from expertax.nn.param import is_spec

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
HUB_QC = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
# dims above 128 and not multiples of it: every weight has partial edge blocks
SMALL = {
    "model_name": "deepseek3-tiny",
    "vocab_size": 300,
    "base_emb_dim": 200,
    "base_mlp_dim": 264,
    "base_moe_mlp_dim": 136,
    "q_lora_rank": 72,
    "kv_lora_rank": 40,
    "num_experts": 8,
    "weight_dtype": "bfloat16",
    "mtp_num_layers": 1,
}
MTP_LAYER = 3  # deepseek3-tiny has 3 layers: the MTP module is model.layers.3


def random_params(c, seed: int):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: rng.standard_normal(s.shape).astype(np.float32).astype(BF16),
        decoder.spec(c),
        is_leaf=is_spec,
    )


def ref_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's recipe, block by block: scale = amax / 448, q = w / scale."""
    rows, cols = w.shape
    grid = np.zeros((-(-rows // 128), -(-cols // 128)), np.float32)
    q = np.zeros(w.shape, FP8)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].astype(np.float32)
            grid[i, j] = np.abs(block).max() / np.float32(448.0)
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / grid[i, j]).astype(FP8)
    return q, grid


def ref_dequantize(q: np.ndarray, grid: np.ndarray) -> np.ndarray:
    out = np.zeros(q.shape, BF16)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            sl = np.s_[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            out[sl] = (q[sl].astype(np.float32) * grid[i, j]).astype(BF16)
    return out


def is_fp8_weight(name: str, w: np.ndarray) -> bool:
    """The hub's fp8 tensors: the projections, but not the MTP layer's eh_proj (bfloat16 in the
    published checkpoint, as are its shared_head.head and the router)."""
    return w.ndim == 2 and "_proj" in name and name.endswith(".weight") and "eh_proj" not in name


def write_checkpoints(root: Path) -> Path:
    """root/hub (fp8, hub quantization_config) and root/deq (the same weights dequantized by the
    reference, bfloat16), both with num_nextn_predict_layers=1 and its layer's tensors."""
    c = expertax.load_config(overrides=SMALL)
    write_hf(random_params(c, 0), c, root / "bf16")
    hf = json.loads((root / "bf16" / "config.json").read_text())
    quantized, dequantized = {}, {}
    for name, w in iter_tensors(root / "bf16"):
        if is_fp8_weight(name, w):
            q, grid = ref_quantize(w)
            quantized[name], quantized[name + "_scale_inv"] = q, grid
            dequantized[name] = ref_dequantize(q, grid)
        else:
            quantized[name] = dequantized[name] = w
    for kind, tensors, extra in (
        ("hub", quantized, {"quantization_config": HUB_QC}),
        ("deq", dequantized, {}),
    ):
        save_hub(root / kind, tensors, {**hf, **extra, "torch_dtype": "bfloat16"})
    return root


def save_hub(path: Path, tensors: dict, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path
