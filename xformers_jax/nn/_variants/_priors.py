"""Registry entries of the priors family (:mod:`xformers_jax.attention.priors`): Gaussian
locality priors, hard-coded Gaussian and average attention, and the multi-head variants whose
heads interact (talking heads, collaborative heads, multi-scale heads).

The multi-head kinds see every head at once, so their ``attend`` maps over the batch only;
grouped key/value heads are repeated to the query heads for them (their heads mix, so a query
head has no single key/value head of its own to share).

Initialisation starts each kind at (or near) vanilla attention where the paper has a
reduction: talking heads' mixing matrices are the identity, collaborative heads' mixing
vectors are head indicators (the exact conversion of a vanilla layer), Guo et al.'s penalty is
small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ... import attention as A
from ...attention.priors._kinds import KINDS
from .._registry import RecurrentDecoding, Variant, lifted, register_variant
from ._linear import _broadcast_state, _grouped_step

_KIND = {k.name: k for k in KINDS}
_TILES = frozenset({"block_q", "block_k"})


def _per_batch(fn, q, k, v, kv_mask, *args):
    """``fn(q [L, H, D], k, v, *args, kv_mask=)`` mapped over the batch."""
    if kv_mask is None:
        return jax.vmap(lambda a, b, c: fn(a, b, c, *args, kv_mask=None))(q, k, v)
    return jax.vmap(lambda a, b, c, m: fn(a, b, c, *args, kv_mask=m))(q, k, v, kv_mask)


def _all_heads(q, k, v):
    """k, v with the query heads' count (grouped heads repeated)."""
    g = q.shape[2] // k.shape[2]
    return (k, v) if g == 1 else (jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2))


# --- Gaussian priors (L 4.5.1) ----------------------------------------------------------------

def _gaussian_init(key, hp, *, num_heads, head_dim, max_len):
    return jax.vmap(lambda kk: A.init_gaussian_window(kk, head_dim))(
        jax.random.split(key, num_heads))


register_variant(Variant.from_kind(
    _KIND["gaussian_prior"], lifted(A.gaussian_prior_attention, ("heads",)),
    init=_gaussian_init, hyperparameters=_TILES,
))


def _distance(q, k, v, wb, **kw):
    w_raw, b_raw = wb
    return A.distance_prior_attention(q, k, v, jax.nn.softplus(w_raw), -jax.nn.softplus(b_raw),
                                      **kw)


def _distance_init(key, hp, *, num_heads, head_dim, max_len):
    # softplus(-3) = 0.049: a mild penalty at the start (w >= 0 and b <= 0 by construction).
    return (jnp.full((num_heads,), -3.0), jnp.full((num_heads,), -3.0))


register_variant(Variant.from_kind(
    _KIND["distance_prior"], lifted(_distance, ("heads",)), init=_distance_init,
    hyperparameters=_TILES,
))

register_variant(Variant.from_kind(
    _KIND["hardcoded_gaussian"], lifted(A.hardcoded_gaussian_attention),
    hyperparameters=_TILES | {"offset", "std"},
))


# --- average attention (L 4.5.4) --------------------------------------------------------------

def _average_init(key, hp, *, num_heads, head_dim, max_len):
    return jax.vmap(lambda kk: A.init_average_gate(kk, head_dim, head_dim))(
        jax.random.split(key, num_heads))


def _average_init_state(batch, heads, dk, dv, params, **hp):
    return _broadcast_state(A.average_attention_init_state(dv), batch, heads)


def _average_step(state, q, k, v, params, **hp):
    w, b = (jnp.broadcast_to(a, (q.shape[0], *a.shape)) for a in params)

    def one(state, q, k, v, w, b):
        return A.average_attention_step(state, q, k, v, A.AverageGate(w, b))

    return _grouped_step(one, state, q, k, v, w, b)


register_variant(Variant.from_kind(
    _KIND["average"], lifted(A.average_attention, ("heads",)), init=_average_init,
    decoding=RecurrentDecoding(_average_init_state, _average_step),
))


# --- talking heads (L 4.6.1) ------------------------------------------------------------------

def _talking_init(key, hp, *, num_heads, head_dim, max_len):
    eye = jnp.eye(num_heads)
    return (eye, eye)


def _talking(q, k, v, params, *, causal, kv_mask, bias, key, q_mask=None,
             implementation="tiled", block_q=None, block_k=None):
    k, v = _all_heads(q, k, v)

    def one(a, b, c, lm, wm, kv_mask):
        return A.talking_heads_attention(a, b, c, lm, wm, causal=causal, kv_mask=kv_mask,
                                         implementation=implementation, block_q=block_q,
                                         block_k=block_k)

    return _per_batch(one, q, k, v, kv_mask, *params)


register_variant(Variant.from_kind(
    _KIND["talking_heads"], _talking, init=_talking_init,
    hyperparameters=_TILES | {"implementation"},
))


# --- collaborative heads (L 4.6.1) ------------------------------------------------------------

def _collaborative_init(key, hp, *, num_heads, head_dim, max_len):
    return A.collaborative_mixing_from_heads(num_heads, head_dim)


def _collaborative(q, k, v, mixing, *, causal, kv_mask, bias, key, q_mask=None, block_q=None,
                   block_k=None):
    # The module's concatenated per-head projections are the shared W^Q, W^K (width H Dh).
    k, v = _all_heads(q, k, v)
    b, lq, h, d = q.shape
    qs, ks = q.reshape(b, lq, h * d), k.reshape(b, k.shape[1], h * d)

    def one(a, c, vv, kv_mask):
        return A.collaborative_attention(a, c, vv, mixing, causal=causal, kv_mask=kv_mask,
                                         scale=float(d) ** -0.5, block_q=block_q,
                                         block_k=block_k)

    return _per_batch(one, qs, ks, v, kv_mask)


register_variant(Variant.from_kind(
    _KIND["collaborative"], _collaborative, init=_collaborative_init, hyperparameters=_TILES,
))


# --- multi-scale heads (L 4.6.2) --------------------------------------------------------------

def _multiscale(q, k, v, params, *, causal, kv_mask, bias, key, q_mask=None, spans,
                block_q=None, block_k=None):
    k, v = _all_heads(q, k, v)
    if len(spans) != q.shape[2]:
        raise ValueError(f"attention kind 'multiscale': spans {spans} must give one span per "
                         f"head, but the layer has {q.shape[2]} heads (q{tuple(q.shape)})")

    def one(a, b, c, kv_mask):
        return A.multiscale_attention(a, b, c, spans=spans, causal=causal, kv_mask=kv_mask,
                                      block_q=block_q, block_k=block_k)

    return _per_batch(one, q, k, v, kv_mask)


register_variant(Variant.from_kind(
    _KIND["multiscale"], _multiscale, hyperparameters=_TILES | {"spans"},
))


# --- scores passed between layers (L 4.5.2): Realformer, Predictive attention, Lazyformer ------
# The stack threads each kind's carry from layer to layer (Variant.layer_carry).

def _heads_map(fn, q, k, v, kv_mask, *per_head, out_axes=(1, 0)):
    """``fn(q [L, D], k, v, *per_head, m)`` over heads (axis 2 of q/k/v, axis 1 of the
    per-head arrays; outputs per ``out_axes``) and the batch; ``m`` is ``kv_mask[b]`` or
    None."""
    def batch(q, k, v, *rest):
        *per, m = rest if kv_mask is not None else (*rest, None)
        return jax.vmap(lambda a, b, c, *p: fn(a, b, c, *p, m), in_axes=(1, 1, 1) +
                        (0,) * len(per), out_axes=out_axes)(q, k, v, *per)

    args = (q, k, v, *per_head) + (() if kv_mask is None else (kv_mask,))
    return jax.vmap(batch)(*args)


def _realformer_carry(batch, lq, lk, hp, *, num_heads, head_dim, num_layers):
    if hp.get("implementation", "dense") == "tiled":
        # Every layer's queries and keys (zeros above the current layer add nothing).
        return (jnp.zeros((num_layers, batch, lq, num_heads, head_dim), jnp.float32),
                jnp.zeros((num_layers, batch, lk, num_heads, head_dim), jnp.float32),
                jnp.zeros((), jnp.int32))
    return jnp.zeros((batch, num_heads, lq, lk), jnp.float32)


def _realformer(q, k, v, params, *, causal, kv_mask, bias, key, carry, q_mask=None,
                implementation="dense", block_q=None, block_k=None):
    k, v = _all_heads(q, k, v)
    if implementation == "dense":
        return _heads_map(lambda a, b, c, prev, m: A.realformer_attention(
            a, b, c, prev, causal=causal, kv_mask=m), q, k, v, kv_mask, carry)
    if implementation != "tiled":
        raise ValueError(f"attention kind 'realformer': implementation must be 'dense' or "
                         f"'tiled', got {implementation!r}")
    qs, ks, t = carry
    qs = jax.lax.dynamic_update_index_in_dim(qs, q.astype(qs.dtype), t, 0)
    ks = jax.lax.dynamic_update_index_in_dim(ks, k.astype(ks.dtype), t, 0)

    def one(qn, kn, c, m):  # qn [n, Lq, D], kn [n, Lk, D], c [Lk, Dv]
        return A.realformer_flash_attention(qn.astype(c.dtype), kn.astype(c.dtype), c,
                                            causal=causal, kv_mask=m, block_q=block_q,
                                            block_k=block_k)

    heads = jax.vmap(one, in_axes=(2, 2, 1, None), out_axes=1)
    if kv_mask is None:
        out = jax.vmap(lambda a, b, c: heads(a, b, c, None), in_axes=(1, 1, 0))(qs, ks, v)
    else:
        out = jax.vmap(heads, in_axes=(1, 1, 0, 0))(qs, ks, v, kv_mask)
    return out, (qs, ks, t + 1)


register_variant(Variant.from_kind(
    _KIND["realformer"], _realformer, layer_carry=_realformer_carry,
    hyperparameters=_TILES | {"implementation"},
))


def _dense_only(name):
    def init(key, hp, *, num_heads, head_dim, max_len):
        if hp.get("implementation", "dense") != "dense":
            raise ValueError(
                f"attention kind {name!r} reads the previous layer's attention map itself, which "
                "a tiled kernel never forms: it is a dense-score kind and cannot run with "
                f"implementation={hp['implementation']!r} (the 'realformer' kind's residual "
                "scores have an exact tiled form)")
        return None if name == "lazy" else A.init_predictive_conv(key, num_heads)
    return init


def _scores_and_count(batch, lq, lk, hp, *, num_heads, head_dim, num_layers):
    return jnp.zeros((batch, num_heads, lq, lk), jnp.float32), jnp.zeros((), jnp.int32)


def _predictive(q, k, v, conv, *, causal, kv_mask, bias, key, carry, q_mask=None, alpha=0.5,
                implementation="dense"):
    k, v = _all_heads(q, k, v)
    prev, t = carry
    # The first layer has no map below it: vanilla attention (alpha = 1).
    a = jnp.where(t == 0, 1.0, alpha)

    def one(q, k, v, prev, m):
        return A.predictive_attention(q, k, v, prev, conv, a, causal=causal, kv_mask=m)

    if kv_mask is None:
        out, s = jax.vmap(lambda *x: one(*x, None))(q, k, v, prev)
    else:
        out, s = jax.vmap(one)(q, k, v, prev, kv_mask)
    return out, (s, t + 1)


register_variant(Variant.from_kind(
    _KIND["predictive"], _predictive, init=_dense_only("predictive"),
    layer_carry=_scores_and_count, dense_scores=True,
    hyperparameters={"alpha", "implementation"},
))


def _lazy(q, k, v, params, *, causal, kv_mask, bias, key, carry, q_mask=None, every=2,
          implementation="dense"):
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"attention kind 'lazy': every must be a positive int, got {every!r}")
    k, v = _all_heads(q, k, v)
    prev, t = carry

    def weights():
        return _heads_map(lambda a, b, c, m: A.attention_weights(
            a, b, causal=causal, kv_mask=m)[0], q, k, v, kv_mask, out_axes=0)

    # Layers between recomputations skip the score computation (lax.cond), not mask it.
    w = jax.lax.cond(t % every == 0, weights, lambda: prev)
    out = jnp.einsum("bhqk,bkhd->bqhd", w, v.astype(jnp.float32)).astype(v.dtype)
    return out, (w, t + 1)


register_variant(Variant.from_kind(
    _KIND["lazy"], _lazy, init=_dense_only("lazy"), layer_carry=_scores_and_count,
    dense_scores=True, hyperparameters={"every", "implementation"},
))
