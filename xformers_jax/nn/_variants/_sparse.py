"""Registry entries for the variants that need more than a per-head function of q, k, v.

* ``per_head_block_sparse``: a different block-sparse pattern per head (Sparse Transformer's
  factorised heads, T1 3.2.4; BlockBERT, P 4.1 Eq 14).
* ``axial``: attention along one axis of a ``shape``-d input flattened in raster order (Ho et
  al.; T1 3.2.5, L 4.1.1.3), e.g. pixels. With ``axis=None`` head ``h`` attends along axis
  ``h % len(shape)``, so one layer covers every axis (the Axial Transformer alternates axes
  over layers instead; a stack shares one spec, so the heads split the axes here).
* ``delta_rule``: fast-weight memory with the delta update (Schlag et al.; L 4.2.2). Its write
  strength is ``beta_t = sigmoid(k_t . w_h + b_h)`` per head, a learned projection of the head's
  key (the paper projects the block input; the key is a linear map of it, so decoding needs no
  extra input). A recurrence: in an encoder it reads left to right.
* ``longformer`` (T1 3.2.6): sliding window plus global tokens whose rows use separate global
  projections ``Q_g, K_g, V_g`` of the block input (the variant's own parameters).
* ``etc`` (T1 3.2.7): the first ``num_global`` positions are ETC's global input (prepend them,
  e.g. one summary token per sentence); they get their own projections and attend to
  everything, while the long input attends to a ``radius`` window and every global token.
  Encoder only, as in the paper.
* ``routing`` (Roy et al.; T1 3.2.9, L 4.1.2): online spherical k-means routing. The per-head
  centroids are not trained by gradients: they live in ``eqx.nn.State`` (build the model with
  ``eqx.nn.make_with_state`` and pass ``state``), updated by an EMA on every training call and
  frozen with ``inference=True``. The state also records the last call's commitment loss,
  which :func:`routing_commitment_loss` sums for the training objective.

Longformer's and ETC's global projections see the block input, so they run in self-attention
only, and a ``"qk"`` position scheme (RoPE) rotates the ordinary projections, not the global
ones. None of these kinds decodes with a cache except ``delta_rule`` (a recurrent state).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import attention as A
from ..attention import patterns as P
from ._attention import MultiHeadAttention
from ._registry import Variant, register_variant


@dataclasses.dataclass(frozen=True)
class ModuleVariant(Variant):
    """A :class:`Variant` that needs more of :class:`MultiHeadAttention` than q, k, v.

    Attributes:
      takes_input: ``attend`` also receives ``inputs`` (the block input ``[B, L, dim]``) and
        ``init`` receives ``dim`` (e.g. Longformer's global projections).
      state_init: ``state_init(key, hp, *, num_heads, head_dim) -> pytree``: the initial value
        of the variant's non-gradient state (an ``eqx.nn.StateIndex`` of the module). ``attend``
        then also receives ``state`` (the current value) and ``inference`` and returns
        ``(out, new_state)``.
    """

    takes_input: bool = False
    state_init: Callable | None = None


def _repeat_kv(q, k, v):
    """Key/value heads repeated over their query-head group (for per-head functions)."""
    groups = q.shape[2] // k.shape[2]
    return jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)


def _over_batch_heads(fn, *arrays, masks):
    """``fn(*[L, D] arrays, masks)`` applied to each batch element and head of ``[B, L, H, D]``
    arrays; ``masks`` is a pytree of ``[B, ...]`` arrays (or None) split over the batch only.
    Outputs ``[L', D']`` come back as ``[B, L', H, D']``."""

    def per_batch(m, *xs):
        return jax.vmap(lambda *ys: fn(*ys, m), in_axes=1, out_axes=1)(*xs)

    return jax.vmap(per_batch)(masks, *arrays)


def _check_heads(kind, hp, num_heads, make):
    heads = hp["heads"] if "heads" in hp else make(num_heads)
    if heads.num_heads != num_heads:
        raise ValueError(
            f"attention kind {kind!r}: PerHead has {heads.num_heads} patterns but the module "
            f"has {num_heads} heads"
        )
    return heads


# --- per-head block-sparse patterns (T1 3.2.4; P 4.1) ----------------------------------------

def _sparse_transformer_heads(hp):
    return lambda n: P.PerHead.sparse_transformer(n, hp["stride"], hp.get("kind", "strided"),
                                                  hp.get("c", 1))


def _per_head_init(key, hp, *, num_heads, head_dim, max_len):
    if "heads" not in hp and "stride" not in hp:
        raise ValueError("attention kind 'per_head_block_sparse': give `heads` (a PerHead) or "
                         "`stride` (Sparse Transformer heads, with `kind` 'strided' or 'fixed')")
    _check_heads("per_head_block_sparse", hp, num_heads, _sparse_transformer_heads(hp))
    return None


def _per_head(q, k, v, params, *, causal, kv_mask, bias, key, heads=None, stride=None,
              kind="strided", c=1, **kw):
    hp = {"stride": stride, "kind": kind, "c": c} if heads is None else {"heads": heads}
    heads = _check_heads("per_head_block_sparse", hp, q.shape[2], _sparse_transformer_heads(hp))
    k, v = _repeat_kv(q, k, v)

    def one(qb, kb, vb, mask):
        return A.per_head_block_sparse_attention(qb, kb, vb, heads, causal=causal,
                                                 kv_mask=mask, **kw)

    return jax.vmap(one)(q, k, v, kv_mask) if kv_mask is not None else jax.vmap(
        lambda a, b, c_: one(a, b, c_, None))(q, k, v)


register_variant(Variant(
    "per_head_block_sparse", _per_head, init=_per_head_init,
    hyperparameters=frozenset({"heads", "stride", "kind", "c", "block_q", "block_k",
                               "implementation"}),
))


# --- axial (T1 3.2.5; L 4.1.1.3) --------------------------------------------------------------

def _axial_init(key, hp, *, num_heads, head_dim, max_len):
    if "shape" not in hp:
        raise ValueError("attention kind 'axial': give `shape`, the input's shape, e.g. "
                         "(height, width)")
    if hp.get("axis") is None and num_heads < len(hp["shape"]):
        raise ValueError(f"attention kind 'axial': axis=None spreads the {len(hp['shape'])} axes "
                         f"over the heads, but there are only {num_heads} heads")
    return None


def _axial(q, k, v, params, *, causal, kv_mask, bias, key, shape, axis=None, **kw):
    k, v = _repeat_kv(q, k, v)
    heads = q.shape[2]
    groups: dict[int, list[int]] = {}
    for h in range(heads):
        groups.setdefault(h % len(shape) if axis is None else axis, []).append(h)
    parts, order = [], []
    for a, idx in groups.items():
        sel = np.asarray(idx)

        def one(q1, k1, v1, mask, a=a):
            return A.axial_attention(q1, k1, v1, shape=shape, axis=a, causal=causal,
                                     kv_mask=mask, **kw)

        parts.append(_over_batch_heads(one, q[:, :, sel], k[:, :, sel], v[:, :, sel],
                                       masks=kv_mask))
        order.extend(idx)
    return jnp.concatenate(parts, axis=2)[:, :, np.argsort(order)]


register_variant(Variant(
    "axial", _axial, init=_axial_init,
    hyperparameters=frozenset({"shape", "axis", "block_q", "block_k", "implementation"}),
))


# --- delta rule (L 4.2.2) ---------------------------------------------------------------------

def _delta_init(key, hp, *, num_heads, head_dim, max_len):
    return {"w": jax.random.normal(key, (num_heads, head_dim)) / math.sqrt(head_dim),
            "b": jnp.zeros((num_heads,))}


def _beta_logits(k, params):
    """``k [..., H, Dk] -> [..., H]``: the write-strength logits."""
    return jnp.einsum("...hd,hd->...h", k.astype(jnp.float32), params["w"]) + params["b"]


def _delta(q, k, v, params, *, causal, kv_mask, bias, key, feature_map="dpfp", **kw):
    k, v = _repeat_kv(q, k, v)
    beta = jnp.moveaxis(_beta_logits(k, params), 1, 2)  # [B, H, L]
    f = A.multihead(functools.partial(A.delta_rule_attention, feature_map=feature_map, **kw),
                    arg_axes=("batch_heads",))
    return f(q, k, v, beta, causal=True, kv_mask=kv_mask)


def _delta_init_state(batch, heads, dk, dv, params, *, feature_map="dpfp", **hp):
    s = A.delta_rule_init_state(dk, dv, feature_map=feature_map)
    return jnp.broadcast_to(s, (batch, heads, *s.shape))


def _delta_step(state, q, k, v, params, *, feature_map="dpfp", **hp):
    groups = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
    step = functools.partial(A.delta_rule_step, feature_map=feature_map)
    return jax.vmap(jax.vmap(step))(state, q, k, v, _beta_logits(k, params))


register_variant(Variant(
    "delta_rule", _delta, init=_delta_init, cache="recurrent",
    hyperparameters=frozenset({"feature_map", "implementation", "chunk_size"}),
    init_state=_delta_init_state, step=_delta_step,
))


# --- Longformer and ETC global projections (T1 3.2.6-3.2.7) ----------------------------------

def _global_projections(key, hp, *, num_heads, head_dim, max_len, dim):
    keys = jax.random.split(key, 3)
    return tuple(jax.random.normal(k, (dim, num_heads * head_dim)) / math.sqrt(dim)
                 for k in keys)


def _project(inputs, params, heads):
    b, length = inputs.shape[:2]
    return tuple((inputs @ w.astype(inputs.dtype)).reshape(b, length, heads, -1)
                 for w in params)


def _longformer(q, k, v, params, *, causal, kv_mask, bias, key, inputs, window,
                global_tokens, dilation=1, **kw):
    k, v = _repeat_kv(q, k, v)

    def one(*xs):
        *xs, mask = xs
        return A.longformer_attention(*xs, window=window, dilation=dilation,
                                      global_tokens=global_tokens, causal=causal, kv_mask=mask,
                                      **kw)

    return _over_batch_heads(one, q, k, v, *_project(inputs, params, q.shape[2]),
                             masks=kv_mask)


register_variant(ModuleVariant(
    "longformer", _longformer, init=_global_projections, takes_input=True,
    hyperparameters=frozenset({"window", "global_tokens", "dilation", "block_q", "block_k"}),
))


def _etc(q, k, v, params, *, causal, kv_mask, bias, key, inputs, num_global, radius, **kw):
    g, length = num_global, q.shape[1]
    if not 0 < g < length:
        raise ValueError(f"attention kind 'etc': num_global={g} must be in [1, {length}) for a "
                         f"sequence of length {length}")
    k, v = _repeat_kv(q, k, v)
    masks = None if kv_mask is None else (kv_mask[:, g:], kv_mask[:, :g])

    def one(*xs):
        *xs, m = xs
        local_mask, global_mask = (None, None) if m is None else m
        return A.etc_attention(*xs, radius=radius, kv_mask=local_mask,
                               global_kv_mask=global_mask, **kw)

    local, glob = _over_batch_heads(one, q[:, g:], k[:, g:], v[:, g:],
                                    *_project(inputs[:, :g], params, q.shape[2]), masks=masks)
    return jnp.concatenate([glob, local], axis=1)


register_variant(ModuleVariant(
    "etc", _etc, init=_global_projections, causal=False, takes_input=True,
    hyperparameters=frozenset({"num_global", "radius", "block_q", "block_k"}),
))


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
             num_clusters=None, decay=0.999):
    f = A.multihead(functools.partial(A.routing_attention, window=window, decay=decay),
                    arg_axes=("heads",))
    out, aux = f(q, k, v, state.state, causal=causal, kv_mask=kv_mask)
    # The EMA update is linear in the batch statistics: average the per-example updates.
    new = jax.tree_util.tree_map(lambda a: a.mean(0), aux.state)
    new = state.state if inference else new
    return out, RoutingCentroids(new, aux.commitment_loss.mean())


register_variant(ModuleVariant(
    "routing", _routing, state_init=_routing_state,
    hyperparameters=frozenset({"num_clusters", "window", "decay"}),
))


def routing_commitment_loss(model, state):
    """The sum over every routing attention in ``model`` (layers of a stack included) of the
    commitment loss its last call recorded in ``state`` (Roy et al.'s auxiliary term, which
    pulls routed queries and keys towards their centroids). Add it, weighted, to the loss."""
    total = jnp.zeros((), jnp.float32)
    modules = jax.tree_util.tree_leaves(model,
                                        is_leaf=lambda x: isinstance(x, MultiHeadAttention))
    for m in modules:
        if isinstance(m, MultiHeadAttention) and m.state_index is not None:
            total = total + jnp.sum(state.get(m.state_index).commitment_loss)
    return total
