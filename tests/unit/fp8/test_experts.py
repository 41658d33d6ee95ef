"""The MoE layer's one fp8 seam (fp8/experts.py): the expert products chosen by the recipe in
context, and nothing in nn/moe that branches on a recipe instead."""

import ast
from pathlib import Path

import jax.numpy as jnp

import expertax
from expertax.fp8 import experts
from expertax.fp8.experts import Fp8Products
from expertax.nn import linear
from expertax.nn.moe.gmm import GroupedProducts
from expertax.preflight import load_config

MOE = Path(expertax.__file__).parent / "nn" / "moe"


def _products(c):
    sizes = jnp.array([3, 0, 5, 2], jnp.int32)
    return experts.products(c, jnp.bfloat16, sizes, None, c.base_emb_dim, c.base_moe_mlp_dim)


def test_the_recipe_in_context_chooses_the_products():
    c = load_config(overrides={"model_name": "mixtral-tiny", "gmm_impl": "tiled"})
    plain = _products(c)
    assert isinstance(plain, GroupedProducts)
    assert plain.kw["backend"] == "tiled" and plain.kw["group_offset"] is None
    with linear.fp8("fp8_blockwise"):
        fp8 = _products(c)
    assert isinstance(fp8, Fp8Products)
    assert (fp8.recipe, fp8.kw["backend"], fp8.dtype) == ("fp8_blockwise", "tiled", jnp.bfloat16)
    assert fp8.in_probes is None and fp8.out_probes is None  # no probe in the context


def _recipe_reads(path: Path) -> list[str]:
    """The reads of the fp8 recipe in a module: `current_fp8()` calls, `.quantization` fields."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("current_fp8", "quantization"):
            found.append(f"{path.name}:{node.lineno} {node.attr}")
    return found


def test_nn_moe_reads_the_recipe_only_to_pass_it_on():
    """The sorted dispatch and the stash ask fp8/experts.py; what reads the recipe in nn/moe is
    the exchange's `shard_map` (ep.py, which sets the same context inside it) and the fused
    routed FFN's refusal of it (routed.py: it has no fp8 products)."""
    reads = [r for p in sorted(MOE.glob("*.py")) for r in _recipe_reads(p)]
    assert sorted({r.split(":")[0] for r in reads}) == ["ep.py", "routed.py"], reads
    assert len(reads) == 2, reads


def test_the_recipe_reads_are_found():
    # negative control: fp8/experts.py reads it, and the scan sees both reads
    found = _recipe_reads(Path(experts.__file__))
    assert any("current_fp8" in r for r in found) and any("quantization" in r for r in found)
