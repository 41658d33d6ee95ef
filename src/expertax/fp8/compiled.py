"""Which kernel multiplies each fp8 product of a compiled program (docs/design/fp8.md).

The fp8 GEMMs trace their products under named scopes (`scopes.FP8_DENSE` for the
dense linears, `scopes.FP8_GROUPED` for the routed experts), which XLA keeps in each instruction's
`op_name`. `by_product(hlo_text)` counts the GEMM custom calls of an optimized program (its
`as_text()`) by (product, kernel): the product one of `PRODUCTS` (a dense linear inside the
MoE layer's scope is a shared expert's), the kernel one of
- `mosaic_gpu_fp8`: a Pallas Mosaic GPU call (`fp8/hopper/`'s e4m3 `wgmma` kernel: the
  only Mosaic GPU kernel under these scopes);
- `cublaslt_fp8`: cuBLASLt's fp8 GEMM (`__cublas$lt$matmul$f8`);
- `cublas_bf16`, `triton`: a dequantized product (cuBLAS, or XLA's or tokamax's Triton).
Calls outside the scopes are counted under the product `other` (router, heads, attention core).
"""

from __future__ import annotations

import collections
import re

from expertax import scopes

_CALL = re.compile(r'custom_call_target="([^"]+)"')
_OP = re.compile(r'op_name="([^"]+)"')
# deepseek3-tiny's dims as whole 128-tiles: MLA's wq_a 256->128, wq_b 128->512, wkv_b
# 128->512, wo 256->256; the dense MLP 256->512->256; experts 256->128->256. wkv_a
# (256 -> kv_lora_rank + qk_rope_head_dim) is not, as DeepSeek-V3's (7168 -> 576) is not: a
# multiple of 64, in the kernel's 64-wide tiles along N.
HOPPER_DIMS = {
    "base_emb_dim": 256,
    "q_lora_rank": 128,
    "kv_lora_rank": 384,  # wkv_a: 256 -> 384 + 64 = 448 = 3.5 x 128, unpadded (as 576)
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "base_mlp_dim": 512,
    "base_moe_mlp_dim": 128,
}
PRODUCTS = tuple(
    f"{who} {what}"
    for who in ("routed experts", "shared experts", "dense linears")
    for what in ("fprop", "dgrad", "wgrad")
)


def kernel_of(target: str) -> str | None:
    """The kernel a GEMM custom call target names, None for other custom calls."""
    if target.startswith("mosaic_gpu"):
        return "mosaic_gpu_fp8"
    if target == "__cublas$lt$matmul$f8":
        return "cublaslt_fp8"
    if target.startswith("__cublas"):
        return "cublas_bf16"
    if "triton" in target:
        return "triton"
    return None


def product_of(op_name: str) -> str:
    """The fp8 product a call's op_name lies in (`PRODUCTS`), or `other`."""
    what = ("fprop", "dgrad", "wgrad")
    for scope, kind in zip(scopes.FP8_GROUPED, what, strict=True):
        if f"/{scope}/" in op_name or op_name.endswith(f"/{scope}"):
            return f"routed experts {kind}"
    for scope, kind in zip(scopes.FP8_DENSE, what, strict=True):
        if f"/{scope}/" in op_name or op_name.endswith(f"/{scope}"):
            who = "shared experts" if "/moe/" in op_name else "dense linears"
            return f"{who} {kind}"
    return "other"


def by_product(hlo_text: str) -> collections.Counter[tuple[str, str]]:
    """(product, kernel) -> the number of GEMM custom calls in the optimized program."""
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in hlo_text.splitlines():
        call = _CALL.search(line)
        kernel = kernel_of(call.group(1)) if call else None
        if kernel is None:
            continue
        op = _OP.search(line)
        counts[(product_of(op.group(1) if op else ""), kernel)] += 1
    return counts
