"""The prior and multi-head kinds as :class:`~xformers_jax.kinds.Kind` records, with their
adapters: Gaussian locality priors, hard-coded Gaussian and average attention, the multi-head
kinds whose heads interact (talking heads, collaborative heads, multi-scale heads), and the
kinds that pass scores between layers.

The multi-head kinds see every head at once, so their ``attend`` maps over the batch only;
grouped key/value heads are repeated to the query heads for them (their heads mix, so a query
head has no single key/value head of its own to share).

Realformer, Predictive attention and Lazyformer pass scores between layers
(:mod:`._cross_layer`): their adapters carry them from layer to layer through the layer stack
(``AttentionAdapter.layer_carry``). Predictive attention and Lazyformer need the previous
layer's attention map itself and are dense-score kinds; Realformer's residual scores have an
exact tiled form.

Initialisation starts each kind at (or near) vanilla attention where the paper has a
reduction: talking heads' mixing matrices are the identity, collaborative heads' mixing
vectors are head indicators (the exact conversion of a vanilla layer), Guo et al.'s penalty is
small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...kinds import REQUIRED, AttentionAdapter, Kind, Paper, RecurrentDecoding
from .._adapters import TILES, broadcast_state, grouped_step, lifted, real_only
from ._average import (AverageGate, average_attention, average_attention_init_state,
                       average_attention_step, init_average_gate)
from ._collaborative import collaborative_attention, collaborative_mixing_from_heads
from ._cross_layer import (attention_weights, init_predictive_conv, lazy_attention,
                           predictive_attention, realformer_attention,
                           realformer_flash_attention)
from ._gaussian import (distance_prior_attention, gaussian_prior_attention,
                        hardcoded_gaussian_attention, init_gaussian_window)
from ._multiscale import multiscale_attention
from ._talking import talking_heads_attention

_DENSE_SCORES = ("dense", "'dense' only: the kind reads the previous layer's attention map")

def _per_batch(fn, q, k, v, kv_mask, *args, segment_ids=None, per_row=()):
    """``fn(q [L, H, D], k, v, *per_row, *args, kv_mask=, segment_ids=)`` mapped over the
    batch: ``per_row`` arrays and the masks split by row, ``args`` shared; a mask not given
    is passed as None."""
    rows = {"kv_mask": kv_mask, "segment_ids": segment_ids}
    given = {n: a for n, a in rows.items() if a is not None}
    fixed = {n: None for n, a in rows.items() if a is None}
    return jax.vmap(lambda a, b, c, p, r: fn(a, b, c, *p, *args, **r, **fixed))(
        q, k, v, tuple(per_row), given)


def _all_heads(q, k, v):
    """k, v with the query heads' count (grouped heads repeated)."""
    g = q.shape[2] // k.shape[2]
    return (k, v) if g == 1 else (jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2))


# --- Gaussian priors (L 4.5.1) ----------------------------------------------------------------

def _gaussian_init(key, hp, *, num_heads, head_dim, max_len):
    return jax.vmap(lambda kk: init_gaussian_window(kk, head_dim))(
        jax.random.split(key, num_heads))


def _distance(q, k, v, wb, **kw):
    w_raw, b_raw = wb
    return distance_prior_attention(q, k, v, jax.nn.softplus(w_raw), -jax.nn.softplus(b_raw),
                                    **kw)


def _distance_init(key, hp, *, num_heads, head_dim, max_len):
    # softplus(-3) = 0.049: a mild penalty at the start (w >= 0 and b <= 0 by construction).
    return (jnp.full((num_heads,), -3.0), jnp.full((num_heads,), -3.0))


# --- average attention (L 4.5.4) --------------------------------------------------------------

def _average_init(key, hp, *, num_heads, head_dim, max_len):
    return jax.vmap(lambda kk: init_average_gate(kk, head_dim, head_dim))(
        jax.random.split(key, num_heads))


def _average_init_state(batch, heads, dk, dv, params, **hp):
    return broadcast_state(average_attention_init_state(dv), batch, heads)


def _average_step(state, q, k, v, params, **hp):
    w, b = (jnp.broadcast_to(a, (q.shape[0], *a.shape)) for a in params)

    def one(state, q, k, v, w, b):
        return average_attention_step(state, q, k, v, AverageGate(w, b))

    return grouped_step(one, state, q, k, v, w, b)


# --- talking heads (L 4.6.1) ------------------------------------------------------------------

def _talking_init(key, hp, *, num_heads, head_dim, max_len):
    eye = jnp.eye(num_heads)
    return (eye, eye)


def _talking(q, k, v, params, *, causal, kv_mask, bias, key, q_mask=None, segment_ids=None,
             implementation="tiled", block_q=None, block_k=None):
    k, v = _all_heads(q, k, v)

    def one(a, b, c, lm, wm, **rows):
        return talking_heads_attention(a, b, c, lm, wm, causal=causal,
                                       implementation=implementation, block_q=block_q,
                                       block_k=block_k, **rows)

    return _per_batch(one, q, k, v, kv_mask, *params, segment_ids=segment_ids)


# --- collaborative heads (L 4.6.1) ------------------------------------------------------------

def _collaborative_init(key, hp, *, num_heads, head_dim, max_len):
    return collaborative_mixing_from_heads(num_heads, head_dim)


def _collaborative(q, k, v, mixing, *, causal, kv_mask, bias, key, q_mask=None,
                   segment_ids=None, block_q=None, block_k=None):
    # The module's concatenated per-head projections are the shared W^Q, W^K (width H Dh).
    k, v = _all_heads(q, k, v)
    b, lq, h, d = q.shape
    qs, ks = q.reshape(b, lq, h * d), k.reshape(b, k.shape[1], h * d)

    def one(a, c, vv, **rows):
        return collaborative_attention(a, c, vv, mixing, causal=causal,
                                       scale=float(d) ** -0.5, block_q=block_q,
                                       block_k=block_k, **rows)

    return _per_batch(one, qs, ks, v, kv_mask, segment_ids=segment_ids)


# --- multi-scale heads (L 4.6.2) --------------------------------------------------------------

def _multiscale(q, k, v, params, *, causal, kv_mask, bias, key, q_mask=None, spans,
                segment_ids=None, block_q=None, block_k=None):
    k, v = _all_heads(q, k, v)
    if len(spans) != q.shape[2]:
        raise ValueError(f"attention kind 'multiscale': spans {spans} must give one span per "
                         f"head, but the layer has {q.shape[2]} heads (q{tuple(q.shape)})")

    def one(a, b, c, **rows):
        return multiscale_attention(a, b, c, spans=spans, causal=causal, block_q=block_q,
                                    block_k=block_k, **rows)

    return _per_batch(one, q, k, v, kv_mask, segment_ids=segment_ids)


# --- scores passed between layers (L 4.5.2): Realformer, Predictive attention, Lazyformer ------
# The stack threads each kind's carry from layer to layer (AttentionAdapter.layer_carry).

def _heads_map(fn, q, k, v, kv_mask, *per_head, segment_ids=None, out_axes=(1, 0)):
    """``fn(q [L, D], k, v, *per_head, kv_mask=, segment_ids=)`` over heads (axis 2 of
    q/k/v, axis 1 of the per-head arrays; outputs per ``out_axes``) and the batch; the masks
    are ``kv_mask[b]`` and ``segment_ids[b]``, or None."""
    rows = {n: a for n, a in (("kv_mask", kv_mask), ("segment_ids", segment_ids))
            if a is not None}
    fixed = {n: None for n in ("kv_mask", "segment_ids") if n not in rows}

    def batch(q, k, v, per, r):
        return jax.vmap(lambda a, b, c, *p: fn(a, b, c, *p, **r, **fixed), in_axes=(1, 1, 1) +
                        (0,) * len(per), out_axes=out_axes)(q, k, v, *per)

    return jax.vmap(batch)(q, k, v, per_head, rows)


def _realformer_carry(batch, lq, lk, hp, *, num_heads, head_dim, num_layers):
    if hp["implementation"] == "tiled":
        # Every layer's queries and keys (zeros above the current layer add nothing).
        return (jnp.zeros((num_layers, batch, lq, num_heads, head_dim), jnp.float32),
                jnp.zeros((num_layers, batch, lk, num_heads, head_dim), jnp.float32),
                jnp.zeros((), jnp.int32))
    return jnp.zeros((batch, num_heads, lq, lk), jnp.float32)


def _realformer(q, k, v, params, *, causal, kv_mask, bias, key, carry, q_mask=None,
                segment_ids=None, implementation="dense", block_q=None, block_k=None):
    k, v = _all_heads(q, k, v)
    if implementation == "dense":
        return _heads_map(lambda a, b, c, prev, **rows: realformer_attention(
            a, b, c, prev, causal=causal, **rows), q, k, v, kv_mask, carry,
            segment_ids=segment_ids)
    if implementation != "tiled":
        raise ValueError(f"attention kind 'realformer': implementation must be 'dense' or "
                         f"'tiled', got {implementation!r}")
    qs, ks, t = carry
    qs = jax.lax.dynamic_update_index_in_dim(qs, q.astype(qs.dtype), t, 0)
    ks = jax.lax.dynamic_update_index_in_dim(ks, k.astype(ks.dtype), t, 0)

    rows = {n: a for n, a in (("kv_mask", kv_mask), ("segment_ids", segment_ids))
            if a is not None}

    def one(qn, kn, c, r):  # qn [n, Lq, D], kn [n, Lk, D], c [Lk, Dv]
        return realformer_flash_attention(qn.astype(c.dtype), kn.astype(c.dtype), c,
                                          causal=causal, block_q=block_q, block_k=block_k,
                                          **r)

    heads = jax.vmap(one, in_axes=(2, 2, 1, None), out_axes=1)
    out = jax.vmap(heads, in_axes=(1, 1, 0, 0))(qs, ks, v, rows)
    return out, (qs, ks, t + 1)


def _dense_only(name):
    def init(key, hp, *, num_heads, head_dim, max_len):
        if hp["implementation"] != "dense":
            raise ValueError(
                f"attention kind {name!r} reads the previous layer's attention map itself, which "
                "a tiled kernel never forms: it is a dense-score kind and cannot run with "
                f"implementation={hp['implementation']!r} (the 'realformer' kind's residual "
                "scores have an exact tiled form)")
        return None if name == "lazy" else init_predictive_conv(key, num_heads)
    return init


def _scores_and_count(batch, lq, lk, hp, *, num_heads, head_dim, num_layers):
    return jnp.zeros((batch, num_heads, lq, lk), jnp.float32), jnp.zeros((), jnp.int32)


def _predictive(q, k, v, conv, *, causal, kv_mask, bias, key, carry, q_mask=None,
                segment_ids=None, alpha=0.5, implementation="dense"):
    k, v = real_only(kv_mask, *_all_heads(q, k, v))
    prev, t = carry
    # The first layer has no map below it: vanilla attention (alpha = 1).
    a = jnp.where(t == 0, 1.0, alpha)

    def one(q, k, v, prev, **rows):
        return predictive_attention(q, k, v, prev, conv, a, causal=causal, **rows)

    out, s = _per_batch(one, q, k, v, kv_mask, segment_ids=segment_ids, per_row=(prev,))
    return out, (s, t + 1)


def _lazy(q, k, v, params, *, causal, kv_mask, bias, key, carry, q_mask=None,
          segment_ids=None, every=2, implementation="dense"):
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"attention kind 'lazy': every must be a positive int, got {every!r}")
    k, v = real_only(kv_mask, *_all_heads(q, k, v))
    prev, t = carry

    def weights():
        return _heads_map(lambda a, b, c, **rows: attention_weights(
            a, b, causal=causal, **rows)[0], q, k, v, kv_mask, segment_ids=segment_ids,
            out_axes=0)

    # Layers between recomputations skip the score computation (lax.cond), not mask it.
    w = jax.lax.cond(t % every == 0, weights, lambda: prev)
    out = jnp.einsum("bhqk,bkhd->bqhd", w, v.astype(jnp.float32)).astype(v.dtype)
    return out, (w, t + 1)

KINDS = (
    Kind("gaussian_prior", gaussian_prior_attention, "priors",
         Paper("Yang et al.", 2018, "Modeling Localness for Self-Attention Networks"),
         time="O(L^2 D)", memory="O(L)", causal=True, segments=True,
         test_hyperparameters={}, hyperparameters=TILES,
         adapter=AttentionAdapter(lifted(gaussian_prior_attention, ("heads",)),
                                  init=_gaussian_init)),
    Kind("distance_prior", distance_prior_attention, "priors",
         Paper("Guo et al.", 2019,
               "Gaussian Transformer: a Lightweight Approach for Natural Language Inference"),
         time="O(L^2 D)", memory="O(L)", causal=True, segments=True,
         test_hyperparameters={}, hyperparameters=TILES,
         adapter=AttentionAdapter(lifted(_distance, ("heads",)), init=_distance_init)),
    Kind("hardcoded_gaussian", hardcoded_gaussian_attention, "priors",
         Paper("You et al.", 2020, "Hard-Coded Gaussian Attention for Neural Machine "
               "Translation"),
         time="O(L^2 D)", memory="O(L)", causal=True, segments=True,
         test_hyperparameters={"offset": 0.0, "std": 1.0},
         hyperparameters={
             "offset": (0.0, "the Gaussian's centre relative to the query position"),
             "std": (1.0, "the Gaussian's standard deviation (positions)"),
             **TILES},
         adapter=AttentionAdapter(lifted(hardcoded_gaussian_attention))),
    Kind("average", average_attention, "priors",
         Paper("Zhang et al.", 2018, "Accelerating Neural Transformer via an Average Attention "
               "Network"),
         time="O(L D^2)", memory="O(L D)", causal=True, decoding="recurrent", segments=True,
         test_hyperparameters={},
         adapter=AttentionAdapter(
             lifted(average_attention, ("heads",)), init=_average_init,
             decoding=RecurrentDecoding(_average_init_state, _average_step))),
    Kind("talking_heads", talking_heads_attention, "priors",
         Paper("Shazeer et al.", 2020, "Talking-Heads Attention"),
         time="O(L^2 H^2 D) tiled, O(L^2 H (D + H)) dense", memory="O(L H^2 D) tiled, "
         "O(H L^2) dense", causal=True, segments=True,
         test_hyperparameters={"implementation": "tiled"},
         hyperparameters={
             "implementation": ("tiled", "'tiled' (online softmax over mixed heads) or "
                                         "'dense'"),
             **TILES},
         adapter=AttentionAdapter(_talking, init=_talking_init)),
    Kind("collaborative", collaborative_attention, "priors",
         Paper("Cordonnier et al.", 2020, "Multi-Head Attention: Collaborate Instead of "
               "Concatenate"),
         time="O(L^2 H Dq)", memory="O(L)", causal=True, segments=True,
         test_hyperparameters={},
         hyperparameters=TILES,
         adapter=AttentionAdapter(_collaborative, init=_collaborative_init)),
    Kind("multiscale", multiscale_attention, "priors",
         Paper("Guo et al.", 2020, "Multi-Scale Self-Attention for Text Classification"),
         time="O(L sum_h w_h D)", memory="O(L max_h w_h)", causal=True, segments=True,
         test_hyperparameters={"spans": (2, None)},
         hyperparameters={
             "spans": (REQUIRED, "one window half-width per head (None: the whole sequence)"),
             **TILES},
         adapter=AttentionAdapter(_multiscale)),
    Kind("realformer", realformer_attention, "priors",
         Paper("He et al.", 2021, "RealFormer: Transformer Likes Residual Attention"),
         time="O(L^2 D) dense, O(L^2 n D) tiled at layer n", memory="O(H L^2) dense, "
         "O(n L D) tiled", causal=True, segments=True, test_hyperparameters={},
         hyperparameters={
             "implementation": ("dense", "'dense' (the previous scores carried) or 'tiled' "
                                         "(every layer's queries and keys carried)"),
             **TILES},
         adapter=AttentionAdapter(_realformer, layer_carry=_realformer_carry)),
    Kind("predictive", predictive_attention, "priors",
         Paper("Wang et al.", 2021, "Predictive Attention Transformer: Improving Transformer "
               "with Attention Map Prediction"),
         time="O(L^2 (D + 9 H))", memory="O(H L^2) (dense scores)", causal=True, segments=True,
         test_hyperparameters={"alpha": 0.5},
         hyperparameters={
             "alpha": (0.5, "weight of this layer's scores against the convolved previous map"),
             "implementation": _DENSE_SCORES},
         adapter=AttentionAdapter(_predictive, init=_dense_only("predictive"),
                                  layer_carry=_scores_and_count, dense_scores=True)),
    Kind("lazy", lazy_attention, "priors",
         Paper("Ying et al.", 2021, "LazyFormer: Self Attention with Lazy Update"),
         time="O(L^2 D), the map every k layers", memory="O(H L^2) (dense scores)",
         causal=True, segments=True, test_hyperparameters={"every": 2},
         hyperparameters={
             "every": (2, "layers k per recomputed attention map (the others reuse it)"),
             "implementation": _DENSE_SCORES},
         adapter=AttentionAdapter(_lazy, init=_dense_only("lazy"),
                                  layer_carry=_scores_and_count, dense_scores=True)),
)
