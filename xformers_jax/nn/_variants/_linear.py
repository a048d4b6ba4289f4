"""Registry entries of the kernelized linear family (:mod:`xformers_jax.attention.linear`):
linear attention, Performer and the delta rule, each decoding with a recurrent state.

``delta_rule`` (Schlag et al.; L 4.2.2): its write strength is ``beta_t = sigmoid(k_t . w_h +
b_h)`` per head, a learned projection of the head's key (the paper projects the block input;
the key is a linear map of it, so decoding needs no extra input). A recurrence: in an encoder
it reads left to right.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ... import attention as A
from ...attention.linear._kinds import KINDS
from ...attention.linear._feature_maps import FEATURE_MAPS
from .._registry import RecurrentDecoding, SequenceParallel, Variant, lifted, register_variant

_KIND = {k.name: k for k in KINDS}
_LINEAR_HP = frozenset({"implementation", "chunk_size"})


def _broadcast_state(state, batch, heads):
    return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (batch, heads, *a.shape)), state)


def _grouped_step(step_one, state, q, k, v, *per_head):
    """``step_one(state, q [Dk], k [Dk], v [Dv], *per_head) -> (out, state)`` over ``[B, H,
    ...]`` states and queries and ``[B, Hkv, ...]`` keys and values: q (and every per-head
    argument) is reshaped to ``[B, Hkv, G, ...]`` so the ``G`` query heads of a group share
    their key/value head, which is not copied."""
    b, h = q.shape[:2]
    hkv = k.shape[1]

    def group(x):
        return x.reshape(b, hkv, h // hkv, *x.shape[2:])

    def merge(x):
        return x.reshape(b, h, *x.shape[3:])

    f = jax.vmap(step_one, in_axes=(0, 0, None, None) + (0,) * len(per_head))
    f = jax.vmap(jax.vmap(f))
    out, state = f(jax.tree_util.tree_map(group, state), group(q), k, v,
                   *map(group, per_head))
    return merge(out), jax.tree_util.tree_map(merge, state)


# --- linear (Katharopoulos et al.; P 4.2, T1 3.2.13) -----------------------------------------

def _linear_init_state(batch, heads, dk, dv, params, *, feature_map="elu", **hp):
    return _broadcast_state(A.linear_attention_init_state(dk, dv, feature_map=feature_map),
                            batch, heads)


def _linear_step(state, q, k, v, params, *, feature_map="elu", **hp):
    step = functools.partial(A.linear_attention_step, feature_map=feature_map)
    return _grouped_step(step, state, q, k, v)


def _sequence_parallel(q, k, v, *arrays, causal=False, kv_mask=None, key=None,
                       feature_map="elu", implementation="chunked", chunk_size=64):
    return A.sequence_parallel_linear_attention(
        q, k, v, *arrays, feature_map=feature_map, causal=causal, kv_mask=kv_mask,
        chunk_size=chunk_size)


def _log_space_causal(feature_map):
    def check(hp, causal):
        name = feature_map(hp)
        if causal and isinstance(name, str) and FEATURE_MAPS[name].log_space:
            return (f"feature map {name!r} stabilises keys by a running maximum over the "
                    "whole prefix, which the per-shard prefix states do not carry; use a "
                    "non-exponential map (elu, relu, dpfp, favor_trig, rfa)")
        return None
    return check


register_variant(Variant.from_kind(
    _KIND["linear"], lifted(A.linear_attention), hyperparameters=_LINEAR_HP | {"feature_map"},
    decoding=RecurrentDecoding(_linear_init_state, _linear_step),
    sequence=SequenceParallel(lifted(_sequence_parallel),
                              _log_space_causal(lambda hp: hp.get("feature_map", "elu"))),
))


# --- Performer (FAVOR+; P 4.2 eqs. 34-35, T1 3.2.14, L 4.2.1) ---------------------------------

_PERFORMER_MAPS = {"softmax": "favor_positive", "relu": "relu"}


def _performer_init(key, hp, *, num_heads, head_dim, max_len):
    # Random features are redrawn by re-initialising with a new key, never trained.
    return A.init_random_projection(key, hp.get("num_features", 2 * head_dim), head_dim)


def _performer(q, k, v, projection, **kw):
    return A.performer_attention(q, k, v, jax.lax.stop_gradient(projection), **kw)


def _performer_sequence_parallel(q, k, v, projection, *, kernel="softmax", **kw):
    return _sequence_parallel(q, k, v, jax.lax.stop_gradient(projection),
                              feature_map=_PERFORMER_MAPS[kernel], **kw)


def _performer_init_state(batch, heads, dk, dv, projection, *, kernel="softmax", **hp):
    state = A.linear_attention_init_state(dk, dv, projection,
                                          feature_map=_PERFORMER_MAPS[kernel])
    return _broadcast_state(state, batch, heads)


def _performer_step(state, q, k, v, projection, *, kernel="softmax", **hp):
    projection = jax.lax.stop_gradient(projection)

    def step(s, q1, k1, v1):
        return A.linear_attention_step(s, q1, k1, v1, projection,
                                       feature_map=_PERFORMER_MAPS[kernel])

    return _grouped_step(step, state, q, k, v)


register_variant(Variant.from_kind(
    _KIND["performer"], lifted(_performer, (None,)), init=_performer_init,
    hyperparameters=_LINEAR_HP | {"num_features", "kernel"}, init_only={"num_features"},
    decoding=RecurrentDecoding(_performer_init_state, _performer_step),
    sequence=SequenceParallel(
        lifted(_performer_sequence_parallel, (None,)),
        _log_space_causal(lambda hp: _PERFORMER_MAPS[hp.get("kernel", "softmax")])),
))


# --- delta rule (L 4.2.2) ---------------------------------------------------------------------

def _delta_init(key, hp, *, num_heads, head_dim, max_len):
    return {"w": jax.random.normal(key, (num_heads, head_dim)) / math.sqrt(head_dim),
            "b": jnp.zeros((num_heads,))}


def _beta_logits(k, params):
    """``k [..., Hkv, Dk] -> [..., H]``: the write-strength logits of every query head, from
    the key of its key/value head."""
    heads, hkv = params["w"].shape[0], k.shape[-2]
    w = params["w"].reshape(hkv, heads // hkv, -1)
    logits = jnp.einsum("...kd,kgd->...kg", k.astype(jnp.float32), w)
    return logits.reshape(*logits.shape[:-2], heads) + params["b"]


def _delta(q, k, v, params, *, causal, kv_mask, bias, key, feature_map="dpfp", q_mask=None,
           **kw):
    beta = jnp.moveaxis(_beta_logits(k, params), 1, 2)  # [B, H, L]
    f = A.multihead(functools.partial(A.delta_rule_attention, feature_map=feature_map, **kw),
                    arg_axes=("batch_heads",))
    return f(q, k, v, beta, causal=True, kv_mask=kv_mask)


def _delta_init_state(batch, heads, dk, dv, params, *, feature_map="dpfp", **hp):
    s = A.delta_rule_init_state(dk, dv, feature_map=feature_map)
    return jnp.broadcast_to(s, (batch, heads, *s.shape))


def _delta_step(state, q, k, v, params, *, feature_map="dpfp", **hp):
    step = functools.partial(A.delta_rule_step, feature_map=feature_map)
    return _grouped_step(step, state, q, k, v, _beta_logits(k, params))


register_variant(Variant.from_kind(
    _KIND["delta_rule"], _delta, init=_delta_init,
    hyperparameters={"feature_map", "implementation", "chunk_size"},
    decoding=RecurrentDecoding(_delta_init_state, _delta_step),
))
