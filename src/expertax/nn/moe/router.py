"""The router: float32 logits -> scores -> (group-limited) top-k -> weights, and balancing stats.

Mixtral: softmax scores, top-k, weights renormalized (`norm_topk_prob`). GPT-OSS: the same
with a trained bias on the logits (`router_logit_bias`); its softmax over the top-k logits is
the renormalized top-k of the softmax over all.
DeepSeek-V3 (arXiv:2412.19437 Sec. 2.1.2): sigmoid scores; a per-expert bias added for the
*selection only* (aux-loss-free balancing, updated outside the gradient from the global expert
loads); experts split into `n_routing_groups`, each token keeps the `topk_routing_group` groups
with the largest sum of their two best scores (DeepSeek-V2: the largest best score,
`routing_group_score`); weights normalized and scaled by
`routed_scaling_factor`. Masked experts get -inf before top-k (as DeepSeek's reference code).

A selection can be imposed (`route(..., imposed_NK)`, `expertax parity --impose-routing`): the
(token, slot) entries >= 0 replace the router's top-k choice, the weights are still this router's
scores of the imposed experts, and the router's own choice is returned beside it (`chosen_NK`),
so that two layouts can be compared without the near-tie flips of a top-k selection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.nn.param import Leaf, Param, ParamSpec, given, optional, params_dataclass, projection


@params_dataclass
class Router:
    w: Param  # [D, E]
    bias: Param  # [E], selection-only, not trained by the optimizer; None when absent
    logit_bias: Param = optional()  # [E], trained, added to the logits (router_logit_bias)


@params_dataclass
class Routing:
    """Per-token choices, and sums the caller reduces over shards before `balance_stats`."""

    experts_NK: jax.Array  # int32
    weights_NK: jax.Array  # float32
    counts_E: jax.Array  # float32: assignments per expert
    prob_sum_E: jax.Array  # float32: sum over tokens of the normalized scores
    # int32 [N, K]: the router's own top-k choice, only when a selection was imposed (else None)
    chosen_NK: jax.Array | None = None


@params_dataclass
class MoEStats:
    load_E: Leaf  # float32 assignments per expert, over all shards
    lb_loss: Leaf  # scalar Switch-style load-balance loss
    dropped: Leaf  # int32 scalar: dropped (token, expert) assignments, all shards
    # float32 [E]: sum over tokens of the normalized scores (with load_E, what lb_loss is made
    # of: a pipeline sums both over microbatches and recomputes lb_loss, models/pipeline.py)
    prob_sum_E: Leaf = None
    # paged stash only (models/stashed_stack.py), else None: int32 1 if the layer's rows did not
    # fit (it is recomputed), and the capacity factor the stack's rows needed so far (float32)
    stash_overflow: Leaf = None
    stash_factor: Leaf = None
    # int32 [B, T, K]: the router's own top-k choice per token, only where a selection was imposed
    # (`route(..., imposed_NK)`; tools/parity/routing.py), else None
    chosen_BTK: Leaf = None


def spec(c: Config) -> Router:
    d, e = c.base_emb_dim, c.num_experts
    bias = (
        ParamSpec((e,), (None,), "zeros", trainable=False, weight_decay=False)
        if c.routed_bias
        else None
    )
    extra = {}
    if c.router_logit_bias:  # GPT-OSS
        extra["logit_bias"] = ParamSpec((e,), (None,), "zeros", weight_decay=False)
    return Router(w=projection((d, e), ("embed", None), d), bias=bias, **extra)


def _group_mask(choice_NE: jax.Array, c: Config) -> jax.Array:
    n, e = choice_NE.shape
    u = c.n_routing_groups
    grouped = choice_NE.reshape(n, u, e // u)  # [N, U, E/U]
    if c.routing_group_score == "max":
        score_NU = grouped.max(-1)
    else:
        score_NU = jax.lax.top_k(grouped, min(2, e // u))[0].sum(-1)
    _, keep_idx = jax.lax.top_k(score_NU, c.topk_routing_group)
    keep_NU = jnp.zeros((n, u), bool).at[jnp.arange(n)[:, None], keep_idx].set(True)
    return jnp.repeat(keep_NU, e // u, axis=1)


def route(p: Router, x_ND: jax.Array, c: Config, imposed_NK: jax.Array | None = None) -> Routing:
    """Route the tokens [N, D]. `imposed_NK` (int32 [N, K], optional): where >= 0, the expert of
    that (token, slot) instead of the router's choice; the router's own choice is then returned as
    `chosen_NK`. Without it the program is the plain router's."""
    logits_NE = jnp.einsum("nd,de->ne", x_ND.astype(jnp.float32), p.w.astype(jnp.float32))
    if (logit_bias_E := given(p.logit_bias)) is not None:
        logits_NE = logits_NE + logit_bias_E.astype(jnp.float32)[None, :]
    if c.use_random_routing:
        key = jax.random.key(17)
        logits_NE = jax.random.normal(key, logits_NE.shape, jnp.float32)
    if c.routed_score_func == "sigmoid":
        scores_NE = jax.nn.sigmoid(logits_NE)
    else:
        scores_NE = jax.nn.softmax(logits_NE, axis=-1)
    choice_NE = jax.lax.stop_gradient(scores_NE)
    if p.bias is not None:
        choice_NE = choice_NE + p.bias.astype(jnp.float32)[None, :]
    if c.uses_routing_groups:
        choice_NE = jnp.where(_group_mask(choice_NE, c), choice_NE, -jnp.inf)
    _, experts_NK = jax.lax.top_k(choice_NE, c.num_experts_per_tok)
    chosen_NK = None
    if imposed_NK is not None:
        chosen_NK = experts_NK.astype(jnp.int32)
        experts_NK = jnp.where(imposed_NK >= 0, imposed_NK, chosen_NK)
    weights_NK = jnp.take_along_axis(scores_NE, experts_NK, axis=-1)
    if c.norm_topk_prob and c.num_experts_per_tok > 1:
        weights_NK = weights_NK / (jnp.sum(weights_NK, -1, keepdims=True) + 1e-20)
    weights_NK = weights_NK * c.routed_scaling_factor
    counts_E = jnp.zeros((c.num_experts,), jnp.float32).at[experts_NK.reshape(-1)].add(1.0)
    probs_NE = scores_NE / jnp.sum(scores_NE, -1, keepdims=True)
    return Routing(experts_NK.astype(jnp.int32), weights_NK, counts_E, probs_NE.sum(0), chosen_NK)


def balance_stats(counts_E, prob_sum_E, num_tokens, c: Config, dropped) -> MoEStats:
    """Switch-Transformer load-balance loss E * sum_e f_e * P_e from global sums.

    f_e: fraction of the N*K assignments that went to e; P_e: mean normalized score of e.
    """
    f_E = counts_E / (num_tokens * c.num_experts_per_tok)
    p_E = prob_sum_E / num_tokens
    lb = c.num_experts * jnp.sum(f_E * p_E)
    return MoEStats(
        load_E=counts_E,
        lb_loss=lb,
        dropped=jnp.asarray(dropped, jnp.int32),
        prob_sum_E=prob_sum_E,
    )


def updated_bias(bias_LE: jax.Array, load_LE: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3 bias update: raise the bias of underloaded experts, lower overloaded ones."""
    mean = jnp.mean(load_LE, axis=-1, keepdims=True)
    return bias_LE + rate * jnp.sign(mean - load_LE).astype(bias_LE.dtype)
