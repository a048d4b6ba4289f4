"""Registry entries of the learned and content-based sparsity family
(:mod:`xformers_jax.attention.learned`).

``routing`` (Roy et al.; T1 3.2.9, L 4.1.2) is online spherical k-means routing. The per-head
centroids are not trained by gradients: they live in ``eqx.nn.State`` (build the model with
``eqx.nn.make_with_state`` and pass ``state``), updated by an EMA on every training call and
frozen with ``inference=True``. The state also records the last call's commitment loss, which
:func:`routing_commitment_loss` sums for the training objective.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ... import attention as A
from ...attention.learned._kinds import KINDS
from .._registry import Variant, lifted, register_variant

_KIND = {k.name: k for k in KINDS}


def _register(name, attend, **fields):
    register_variant(Variant.from_kind(_KIND[name], attend, **fields))


def _lsh_init(key, hp, *, num_heads, head_dim, max_len):
    return A.init_lsh_rotations(key, head_dim, hp.get("num_buckets", 4), hp.get("num_rounds", 1))


def _lsh(q, k, v, rotations, **kw):
    # Reformer's shared-QK attention: keys are the (normalised) queries.
    return A.lsh_attention(q, q, v, jax.lax.stop_gradient(rotations), **kw)


_register("lsh", lifted(_lsh, (None,)), init=_lsh_init,
          hyperparameters={"num_buckets", "num_rounds", "chunk_size"},
          init_only={"num_buckets", "num_rounds"})
_register(
    "sinkhorn", lifted(A.sinkhorn_attention, (None,)),
    init=lambda key, hp, *, head_dim, max_len, **s: A.init_sinkhorn_sort_net(
        key, head_dim, -(-max_len // hp["block_size"])),
    hyperparameters={"block_size", "temperature", "iterations", "hard", "sortcut"},
)
_register("entmax", lifted(A.entmax_attention), hyperparameters={"alpha", "n_iter"})
_register("topk", lifted(A.topk_attention), hyperparameters={"top_k"})
_register(
    "adaptive_span", lifted(A.adaptive_span_attention, ("heads",)),
    init=lambda key, hp, *, num_heads, **s: jnp.full((num_heads,), hp["max_span"] / 2,
                                                     jnp.float32),
    hyperparameters={"max_span", "ramp", "block_size"},
)
_register("dam", lifted(A.dam_attention, (None,)),
          init=lambda key, hp, *, max_len, **s: A.init_dam_logits(max_len),
          hyperparameters={"temperature", "always_on_ends"})


# --- routing (T1 3.2.9; L 4.1.2) --------------------------------------------------------------

class RoutingCentroids(NamedTuple):
    """The ``eqx.nn.State`` value of one routing attention: per-head k-means state
    (``sums [H, K, Dk]``, ``counts [H, K]``) and the last call's commitment loss (a scalar,
    the mean over batch and heads; with a leading layer axis inside a scanned stack)."""

    state: A.RoutingState
    commitment_loss: jax.Array


def _routing_state(key, hp, *, num_heads, head_dim):
    keys = jax.random.split(key, num_heads)
    state = jax.vmap(lambda k: A.init_routing_state(k, hp.get("num_clusters", 4), head_dim))(keys)
    return RoutingCentroids(state, jnp.zeros((), jnp.float32))


def _routing(q, k, v, params, *, causal, kv_mask, bias, key, state, inference, window,
             num_clusters=None, decay=0.999, q_mask=None):
    f = A.multihead(functools.partial(A.routing_attention, window=window, decay=decay),
                    arg_axes=("heads",))
    out, aux = f(q, k, v, state.state, causal=causal, kv_mask=kv_mask, q_mask=q_mask)
    # The EMA update is linear in the batch statistics: average the per-example updates.
    new = jax.tree_util.tree_map(lambda a: a.mean(0), aux.state)
    new = state.state if inference else new
    return out, RoutingCentroids(new, aux.commitment_loss.mean())


_register("routing", _routing, state=_routing_state,
          hyperparameters={"num_clusters", "window", "decay"})


def routing_commitment_loss(model, state):
    """The sum over every routing attention in ``model`` (layers of a stack included) of the
    commitment loss its last call recorded in ``state`` (Roy et al.'s auxiliary term, which
    pulls routed queries and keys towards their centroids). Add it, weighted, to the loss."""
    from .._attention import MultiHeadAttention  # the registry is imported before the module

    total = jnp.zeros((), jnp.float32)
    modules = jax.tree_util.tree_leaves(model,
                                        is_leaf=lambda x: isinstance(x, MultiHeadAttention))
    for m in modules:
        if isinstance(m, MultiHeadAttention) and m.state_index is not None:
            total = total + jnp.sum(state.get(m.state_index).commitment_loss)
    return total
