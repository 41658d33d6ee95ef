"""What context parallelism (context.py) needs of the attention kernels, checked before anything
is traced: a kernel that takes its queries' offset at run time, the whole sequence's queries in
one call, and (blockwise) each device's query chunk in whole blocks. Field-against-field checks
of the context keys are the config's (config/checks/parallel.py); the mesh's even split is
sharding's (`sharding.mesh.check_context_fit`)."""

from __future__ import annotations

from expertax.config.schema import Config
from expertax.errors import ConfigError
from expertax.nn.attention import context
from expertax.nn.attention.blockwise import DEFAULT_BLOCK
from expertax.sharding.mesh import context_pieces

# splash's tiles along the query and key rows
SPLASH_ROWS = 128


def check(c: Config) -> None:
    """The kernel this config runs under context parallelism can take a context shard."""
    sizes = {k: getattr(c, k) for k in ("ici_context_parallelism", "dcn_context_parallelism")}
    on = {k: v for k, v in sizes.items() if v != 1}
    if not on:
        return
    key, value = next(iter(on.items()))
    if c.attention_impl == "cudnn":
        raise ConfigError(
            f"attention_impl=cudnn with {key}={value}: cuDNN's causal mask (through jax.nn."
            "dot_product_attention) is aligned to the first key and built by row, and a context "
            "shard's queries sit at offsets known only on the device; use attention_impl=auto, "
            "dot or blockwise"
        )
    if c.attention_impl == "splash":
        cp = sizes["ici_context_parallelism"] * sizes["dcn_context_parallelism"]
        pieces = 2 * cp if c.context_parallel_load_balance else cp
        if c.max_target_length % (pieces * SPLASH_ROWS):
            raise ConfigError(
                f"attention_impl=splash with {key}={value}: max_target_length="
                f"{c.max_target_length} must split into {pieces} chunks of a multiple of "
                f"{SPLASH_ROWS} rows (the kernel's tiles), i.e. be a multiple of "
                f"{pieces * SPLASH_ROWS}"
            )
    if c.context_parallel_strategy == "ring":
        impl = context.kernel_impl(c, c.max_target_length)
        if c.attention_type != "mla" or impl != "blockwise":
            raise ConfigError(
                f"context_parallel_strategy=ring with {key}={value}: the ring passes MLA's "
                "latent through its blockwise kernel, and this model has attention_type="
                f"{c.attention_type} with attention_impl={c.attention_impl} (runs {impl}); use "
                "context_parallel_strategy=all_gather, or attention_impl=blockwise on an MLA "
                "model"
            )


def check_layout(c: Config, shape: dict[str, int]) -> None:
    """With the blockwise kernel, each device's query chunk splits into whole blocks
    (`blockwise.DEFAULT_BLOCK`, or the chunk itself when shorter), so no block is padded. Runs
    after `sharding.mesh.check_context_fit` (the sequence splits evenly over the context axis)."""
    cp, pieces, how = context_pieces(c, shape)
    if cp == 1:
        return
    t = c.max_target_length
    chunk = t // pieces
    block = min(DEFAULT_BLOCK, chunk)
    if context.kernel_impl(c, t) == "blockwise" and chunk % block:
        step = pieces * block
        valid = [step * k for k in range(max(1, t // step), t // step + 3)]
        raise ConfigError(
            f"max_target_length={t} with context={cp} ({how} = {pieces} chunks of {chunk} "
            f"tokens) and attention_impl={c.attention_impl} (blockwise): a chunk is not a whole "
            f"number of {block}-token blocks; use a max_target_length that is a multiple of "
            f"{step} (such as {valid}), or another ici_context_parallelism"
        )
