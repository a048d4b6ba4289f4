"""The kernelized linear kinds as :class:`~xformers_jax.kinds.Kind` records, with their
adapters: linear attention, Performer, Based and the delta rule, each decoding with a recurrent
state.

``based`` (Arora et al. 2024): linear attention with the second-order Taylor map on queries
and keys projected to ``feature_dim`` (16 in the paper) by a learned ``[D, feature_dim]`` map
shared by the heads (the paper projects the block input per head; the head's q and k are
linear maps of it). The paper's small sliding-window softmax (window 64) runs in separate
layers of its stack (the ``local`` kind with ``causal=True``), not inside this kind.

``delta_rule`` (Schlag et al.; L 4.2.2): its write strength is ``beta_t = sigmoid(k_t . w_h +
b_h)`` per head, a learned projection of the head's key (the paper projects the block input;
the key is a linear map of it, so decoding needs no extra input). A recurrence: in an encoder
it reads left to right.

Packed rows: ``linear``, ``performer`` and ``based`` honour segment ids (the scan's state and
the exponential maps' key stabiliser restart at each document's first token; feature maps and
Based's shared projection are per token).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ... import axes as X
from ...kinds import AttentionAdapter, Kind, Paper, RecurrentDecoding, SequenceParallel
from .._adapters import broadcast_state, grouped_step, lifted, real_only
from .._multihead import multihead
from ._delta import delta_rule_attention, delta_rule_init_state, delta_rule_step
from ._feature_maps import FEATURE_MAPS, init_random_projection
from ._linear import (linear_attention, linear_attention_init_state, linear_attention_step,
                      performer_attention)
from ._sequence_parallel import sequence_parallel_linear_attention

_SCAN = {
    "implementation": ("chunked", "the causal form: 'chunked' (chunkwise parallel) or "
                                  "'recurrent'"),
    "chunk_size": (64, "positions per chunk of the chunked scan"),
}


# --- linear (Katharopoulos et al.; P 4.2, T1 3.2.13) -----------------------------------------

def _linear_init_state(batch, heads, dk, dv, params, *, feature_map="elu", **hp):
    return broadcast_state(linear_attention_init_state(dk, dv, feature_map=feature_map),
                           batch, heads)


def _linear_step(state, q, k, v, params, *, feature_map="elu", **hp):
    step = functools.partial(linear_attention_step, feature_map=feature_map)
    return grouped_step(step, state, q, k, v)


def _sequence_parallel(q, k, v, *arrays, causal=False, kv_mask=None, key=None,
                       feature_map="elu", implementation="chunked", chunk_size=64):
    return sequence_parallel_linear_attention(
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


# --- Performer (FAVOR+; P 4.2 eqs. 34-35, T1 3.2.14, L 4.2.1) ---------------------------------

_PERFORMER_MAPS = {"softmax": "favor_positive", "relu": "relu"}


def _performer_init(key, hp, *, num_heads, head_dim, max_len):
    # Random features are redrawn by re-initialising with a new key, never trained: a fixed
    # buffer, which no optimizer updates or decays.
    m = 2 * head_dim if hp["num_features"] is None else hp["num_features"]
    return X.Buffer(init_random_projection(key, m, head_dim))


def _performer(q, k, v, projection, **kw):
    return performer_attention(q, k, v, jax.lax.stop_gradient(projection), **kw)


def _performer_sequence_parallel(q, k, v, projection, *, kernel="softmax", **kw):
    return _sequence_parallel(q, k, v, jax.lax.stop_gradient(projection),
                              feature_map=_PERFORMER_MAPS[kernel], **kw)


def _performer_init_state(batch, heads, dk, dv, projection, *, kernel="softmax", **hp):
    state = linear_attention_init_state(dk, dv, projection,
                                        feature_map=_PERFORMER_MAPS[kernel])
    return broadcast_state(state, batch, heads)


def _performer_step(state, q, k, v, projection, *, kernel="softmax", **hp):
    projection = jax.lax.stop_gradient(projection)

    def step(s, q1, k1, v1):
        return linear_attention_step(s, q1, k1, v1, projection,
                                     feature_map=_PERFORMER_MAPS[kernel])

    return grouped_step(step, state, q, k, v)


# --- Based (Arora et al. 2024) -----------------------------------------------------------------

def _based_init(key, hp, *, num_heads, head_dim, max_len):
    return jax.random.normal(key, (head_dim, hp["feature_dim"])) / math.sqrt(head_dim)


def _based(q, k, v, w, *, causal, kv_mask, bias, key, q_mask=None, **hp):
    # Padded rows are zeroed before the shared projection: junk there would reach w's
    # gradient through the product (0 * NaN).
    k, v = real_only(kv_mask, k, v)
    if q_mask is not None:
        q = jnp.where(q_mask[:, :, None, None], q, jnp.zeros((), q.dtype))
    w = w.astype(q.dtype)
    return lifted(linear_attention)(q @ w, k @ w, v, None, causal=causal, kv_mask=kv_mask,
                                    bias=bias, key=key, feature_map="taylor", **hp)


def _based_init_state(batch, heads, dk, dv, w, **hp):
    state = linear_attention_init_state(w.shape[1], dv, feature_map="taylor")
    return broadcast_state(state, batch, heads)


def _based_step(state, q, k, v, w, **hp):
    step = functools.partial(linear_attention_step, feature_map="taylor")
    w = w.astype(q.dtype)
    return grouped_step(step, state, q @ w, k @ w, v)


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
           segment_ids=None, **kw):
    k, v = real_only(kv_mask, k, v)
    beta = jnp.moveaxis(_beta_logits(k, params), 1, 2)  # [B, H, L]
    f = multihead(functools.partial(delta_rule_attention, feature_map=feature_map, **kw),
                  arg_axes=("batch_heads",))
    seg = {} if segment_ids is None else {"segment_ids": segment_ids}  # split over the batch
    return f(q, k, v, beta, causal=True, kv_mask=kv_mask, **seg)


def _delta_init_state(batch, heads, dk, dv, params, *, feature_map="dpfp", **hp):
    s = delta_rule_init_state(dk, dv, feature_map=feature_map)
    return jnp.broadcast_to(s, (batch, heads, *s.shape))


def _delta_step(state, q, k, v, params, *, feature_map="dpfp", **hp):
    step = functools.partial(delta_rule_step, feature_map=feature_map)
    return grouped_step(step, state, q, k, v, _beta_logits(k, params))


KINDS = (
    Kind("linear", linear_attention, "linear",
         Paper("Katharopoulos et al.", 2020,
               "Transformers are RNNs: Fast Autoregressive Transformers with Linear Attention"),
         time="O(L D^2)", memory="O(L D + (L/c) D^2)", causal=True, decoding="recurrent",
         segments=True, test_hyperparameters={"chunk_size": 8},
         hyperparameters={"feature_map": ("elu", "the feature map phi: 'elu', 'relu', 'dpfp', "
                                                 "... or a callable"),
                          **_SCAN},
         adapter=AttentionAdapter(
             lifted(linear_attention),
             decoding=RecurrentDecoding(_linear_init_state, _linear_step),
             sequence=SequenceParallel(lifted(_sequence_parallel),
                                       _log_space_causal(lambda hp: hp["feature_map"])))),
    Kind("performer", performer_attention, "linear",
         Paper("Choromanski et al.", 2021, "Rethinking Attention with Performers"),
         time="O(L m D), m random features", memory="O(L m + (L/c) m D)", causal=True,
         decoding="recurrent", segments=True,
         test_hyperparameters={"num_features": 16, "chunk_size": 8},
         hyperparameters={
             "num_features": (None, "random features m (None: twice the head width)"),
             "kernel": ("softmax", "the approximated kernel: 'softmax' (FAVOR+) or 'relu'"),
             **_SCAN},
         adapter=AttentionAdapter(
             lifted(_performer, (None,)), init=_performer_init, init_only={"num_features"},
             decoding=RecurrentDecoding(_performer_init_state, _performer_step),
             sequence=SequenceParallel(
                 lifted(_performer_sequence_parallel, (None,)),
                 _log_space_causal(lambda hp: _PERFORMER_MAPS[hp["kernel"]])))),
    Kind("based", linear_attention, "linear",
         Paper("Arora et al.", 2024, "Simple linear attention language models balance the "
               "recall-throughput tradeoff"),
         time="O(L F^2 D), F = feature_dim", memory="O(L F^2 + (L/c) F^2 D)", causal=True,
         decoding="recurrent", state_size="H ((1 + F + F^2)(D + 1) + 1)", segments=True,
         test_hyperparameters={"feature_dim": 4, "chunk_size": 8},
         hyperparameters={"feature_dim": (16, "width F of the projected queries and keys (the "
                                              "Taylor map has 1 + F + F^2 features)"),
                          **_SCAN},
         adapter=AttentionAdapter(
             _based, init=_based_init, init_only={"feature_dim"},
             decoding=RecurrentDecoding(_based_init_state, _based_step))),
    Kind("delta_rule", delta_rule_attention, "linear",
         Paper("Schlag et al.", 2021, "Linear Transformers Are Secretly Fast Weight Programmers"),
         time="O(L M D), M features", memory="O(L M + (L/c) M D)", causal=True,
         decoding="recurrent", segments=True, test_hyperparameters={"chunk_size": 8},
         hyperparameters={"feature_map": ("dpfp", "the feature map phi: 'dpfp', 'elu', ... or a "
                                                  "callable"),
                          **_SCAN},
         adapter=AttentionAdapter(
             _delta, init=_delta_init,
             decoding=RecurrentDecoding(_delta_init_state, _delta_step))),
)
