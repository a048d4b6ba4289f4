"""The learned and content-based sparsity kinds as :class:`~xformers_jax.kinds.Kind` records,
with their adapters.

``routing`` (Roy et al.; T1 3.2.9, L 4.1.2) is online spherical k-means routing. The per-head
centroids are not trained by gradients: they live in ``eqx.nn.State`` (build the model with
``eqx.nn.make_with_state`` and pass ``state``), a :class:`RoutingCentroids` updated by an EMA on
every training call and frozen with ``inference=True``. The state also records the last call's
commitment loss, which ``nn.routing_commitment_loss`` sums for the training objective.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ... import axes as X
from ...kinds import REQUIRED, AttentionAdapter, Kind, Paper
from .._adapters import lifted
from .._multihead import multihead
from ._adaptive_span import adaptive_span_attention
from ._dam import dam_attention, init_dam_logits
from ._entmax import entmax_attention
from ._lsh import init_lsh_rotations, lsh_attention
from ._routing import RoutingState, init_routing_state, routing_attention
from ._sinkhorn import init_sinkhorn_sort_net, sinkhorn_attention
from ._topk import topk_attention


def _lsh_init(key, hp, *, num_heads, head_dim, max_len):
    # Reformer's random rotations are fixed (never trained): a buffer.
    return X.Buffer(init_lsh_rotations(key, head_dim, hp["num_buckets"], hp["num_rounds"]))


def _lsh(q, k, v, rotations, **kw):
    # Reformer's shared-QK attention: keys are the (normalised) queries.
    return lsh_attention(q, q, v, jax.lax.stop_gradient(rotations), **kw)


# --- routing (T1 3.2.9; L 4.1.2) --------------------------------------------------------------

class RoutingCentroids(NamedTuple):
    """The ``eqx.nn.State`` value of one routing attention: per-head k-means state
    (``sums [H, K, Dk]``, ``counts [H, K]``) and the last call's commitment loss (a scalar,
    the mean over batch and heads; with a leading layer axis inside a scanned stack)."""

    state: RoutingState
    commitment_loss: jax.Array


def _routing_state(key, hp, *, num_heads, head_dim):
    keys = jax.random.split(key, num_heads)
    state = jax.vmap(lambda k: init_routing_state(k, hp["num_clusters"], head_dim))(keys)
    return RoutingCentroids(state, jnp.zeros((), jnp.float32))


def _routing(q, k, v, params, *, causal, kv_mask, bias, key, state, inference, window,
             num_clusters=4, decay=0.999, q_mask=None):
    f = multihead(functools.partial(routing_attention, window=window, decay=decay),
                  arg_axes=("heads",))
    out, aux = f(q, k, v, state.state, causal=causal, kv_mask=kv_mask, q_mask=q_mask)
    # The EMA update is linear in the batch statistics: average the per-example updates.
    new = jax.tree_util.tree_map(lambda a: a.mean(0), aux.state)
    new = state.state if inference else new
    return out, RoutingCentroids(new, aux.commitment_loss.mean())


KINDS = (
    Kind("lsh", lsh_attention, "learned",
         Paper("Kitaev et al.", 2020, "Reformer: The Efficient Transformer"),
         time="O(n L (c + log L) D), n rounds, c chunk", memory="O(n L c)", causal=True,
         segments=lambda hp: (
             "it sorts the whole row by hash bucket and attends within chunks of the sorted "
             "order, so which keys share a query's chunk depends on the other documents; train "
             "it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"num_buckets": 4, "chunk_size": 4},
         hyperparameters={
             "num_buckets": (4, "hash buckets per round (even)"),
             "num_rounds": (1, "hashing rounds n"),
             "chunk_size": (128, "sorted chunk length c")},
         adapter=AttentionAdapter(lifted(_lsh, (None,)), init=_lsh_init,
                                  init_only={"num_buckets", "num_rounds"})),
    Kind("sinkhorn", sinkhorn_attention, "learned",
         Paper("Tay et al.", 2020, "Sparse Sinkhorn Attention"),
         time="O(L b D + (L/b)^2), b the block", memory="O(L b + (L/b)^2)", causal=True,
         segments=lambda hp: (
             f"its sorting network permutes blocks of {hp['block_size']} positions of the row "
             "(blocks straddle documents, and a block's sort logits pool its tokens), so a "
             "document's keys depend on the other documents; train it on unpacked rows "
             "(data.pack=False)"),
         fixed_length=True, test_hyperparameters={"block_size": 4},
         hyperparameters={
             "block_size": (REQUIRED, "tokens per sorted block b"),
             "temperature": (0.75, "temperature of the Gumbel-Sinkhorn sort"),
             "iterations": (8, "Sinkhorn normalisation iterations"),
             "hard": (False, "a hard permutation (straight-through gradients)"),
             "sortcut": (None, "attend to the first sortcut sorted blocks only (None: all)")},
         adapter=AttentionAdapter(
             lifted(sinkhorn_attention, (None,)),
             init=lambda key, hp, *, head_dim, max_len, **s: init_sinkhorn_sort_net(
                 key, head_dim, -(-max_len // hp["block_size"])))),
    Kind("entmax", entmax_attention, "learned",
         Paper("Correia et al.", 2019, "Adaptively Sparse Transformers"),
         time="O(L^2 D)", memory="O(L^2)", causal=True, segments=True,
         test_hyperparameters={},
         hyperparameters={
             "alpha": (1.5, "the entmax parameter (>= 1; 1 is softmax, 2 sparsemax)"),
             "n_iter": (50, "bisection steps (an array or non-special alpha)")},
         adapter=AttentionAdapter(lifted(entmax_attention))),
    Kind("topk", topk_attention, "learned",
         Paper("Gupta et al.", 2021, "Memory-efficient Transformers via Top-k Attention"),
         time="O(L^2 D)", memory="O(L^2)", causal=True, segments=True,
         test_hyperparameters={"top_k": 4},
         hyperparameters={"top_k": (REQUIRED, "keys kept per query")},
         adapter=AttentionAdapter(lifted(topk_attention))),
    Kind("adaptive_span", adaptive_span_attention, "learned",
         Paper("Sukhbaatar et al.", 2019, "Adaptive Attention Span in Transformers"),
         time="O(L (S + R) D), S the maximum span", memory="O(L (S + R))", causal=True,
         segments=True,
         test_hyperparameters={"max_span": 8, "ramp": 2},
         hyperparameters={
             "max_span": (REQUIRED, "static upper bound S of the learned span (tokens)"),
             "ramp": (32, "the soft ramp length R (> 0)"),
             "block_size": (None, "tile of the block-sparse band (None: fits the band)")},
         adapter=AttentionAdapter(
             lifted(adaptive_span_attention, ("heads",)),
             init=lambda key, hp, *, num_heads, **s: jnp.full((num_heads,), hp["max_span"] / 2,
                                                              jnp.float32))),
    Kind("dam", dam_attention, "learned",
         Paper("Shi et al.", 2021,
               "SparseBERT: Rethinking the Importance Analysis in Self-attention"),
         time="O(L^2 D)", memory="O(L^2)", causal=False, fixed_length=True,
         segments=lambda hp: (
             "its learned mask is indexed by positions of the row (and keeps the row's "
             "first and last rows and columns), so a document packed at an offset gets "
             "another mask than alone; train it on unpacked rows (data.pack=False)"),
         test_hyperparameters={},
         hyperparameters={
             "temperature": (1.0, "temperature tau of the Gumbel-sigmoid gates"),
             "always_on_ends": (True, "keep the first and last rows and columns of the mask")},
         adapter=AttentionAdapter(lifted(dam_attention, (None,)),
                                  init=lambda key, hp, *, max_len, **s: init_dam_logits(
                                      max_len))),
    Kind("routing", routing_attention, "learned",
         Paper("Roy et al.", 2021,
               "Efficient Content-Based Sparse Attention with Routing Transformers"),
         time="O(L w D + L K D), w the cluster window", memory="O(L w)", causal=True,
         segments=lambda hp: (
             "it sorts the whole row by k-means cluster and attends within windows of the "
             "sorted order, so which keys a query sees depends on the other documents; train "
             "it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"num_clusters": 2, "window": 4},
         hyperparameters={
             "num_clusters": (4, "k-means centroids K per head"),
             "window": (REQUIRED, "queries/keys per cluster (non-causal) or keys per query "
                                  "(causal)"),
             "decay": (0.999, "the EMA factor of the centroid updates")},
         adapter=AttentionAdapter(_routing, state=_routing_state)),
)
