"""Registry entries for the attention families beyond exact softmax (see :mod:`._registry`).

Each entry adapts one function of :mod:`xformers_jax.attention` to the module: which of its
hyperparameters only shape the initial parameters, how its arrays are created from a key, and
its decoding cache. The kinds that need more than a per-head function of q, k, v (routing,
delta rule, Longformer, ETC, axial, per-head block-sparse) are in :mod:`._variants_extra`. Not
registered: the Funnel / TokenLearner down-sampling functions (they change the sequence length,
so they belong between blocks, not inside attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import attention as A
from ._registry import Variant, lifted, register_variant

_LINEAR_HP = frozenset({"implementation", "chunk_size"})


def _broadcast_state(state, batch, heads):
    return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (batch, heads, *a.shape)), state)


def _recurrent_step(step_one):
    """Lifts ``step_one(state, q [Dk], k [Dk], v [Dv], params) -> (out, state)`` to
    ``[B, H, ...]`` with key/value heads repeated over their query-head group."""

    def step(state, q, k, v, params, **hp):
        groups = q.shape[1] // k.shape[1]
        k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
        f = jax.vmap(lambda s, q1, k1, v1: step_one(s, q1, k1, v1, params, **hp))
        return jax.vmap(f)(state, q, k, v)

    return step


# --- linear (Katharopoulos et al.; P 4.2, T1 3.2.13) -----------------------------------------

def _linear(q, k, v, *, feature_map="elu", key=None, **kw):
    return A.linear_attention(q, k, v, feature_map=feature_map, **kw)


def _linear_init_state(batch, heads, dk, dv, params, *, feature_map="elu", **hp):
    return _broadcast_state(A.linear_attention_init_state(dk, dv, feature_map=feature_map),
                            batch, heads)


def _linear_step(state, q, k, v, params, *, feature_map="elu", **hp):
    out, state = A.linear_attention_step(state, q, k, v, feature_map=feature_map)
    return out, state


register_variant(Variant(
    "linear", lifted(_linear), cache="recurrent", hyperparameters=_LINEAR_HP | {"feature_map"},
    init_state=_linear_init_state, step=_recurrent_step(_linear_step),
))


# --- Performer (FAVOR+; P 4.2 eqs. 34-35, T1 3.2.14, L 4.2.1) ---------------------------------

_PERFORMER_MAPS = {"softmax": "favor_positive", "relu": "relu"}


def _performer_init(key, hp, *, num_heads, head_dim, max_len):
    # Random features are redrawn by re-initialising with a new key, never trained.
    return A.init_random_projection(key, hp.get("num_features", 2 * head_dim), head_dim)


def _performer(q, k, v, projection, *, num_features=None, key=None, **kw):
    return A.performer_attention(q, k, v, jax.lax.stop_gradient(projection), **kw)


def _performer_init_state(batch, heads, dk, dv, projection, *, kernel="softmax", **hp):
    state = A.linear_attention_init_state(dk, dv, projection,
                                          feature_map=_PERFORMER_MAPS[kernel])
    return _broadcast_state(state, batch, heads)


def _performer_step(state, q, k, v, projection, *, kernel="softmax", **hp):
    return A.linear_attention_step(state, q, k, v, jax.lax.stop_gradient(projection),
                                   feature_map=_PERFORMER_MAPS[kernel])


register_variant(Variant(
    "performer", lifted(_performer, arg_axes=(None,)), init=_performer_init, cache="recurrent",
    hyperparameters=_LINEAR_HP | {"num_features", "kernel"},
    init_state=_performer_init_state, step=_recurrent_step(_performer_step),
))


# --- low rank and compression (issue 5) -------------------------------------------------------

def _linformer_init(key, hp, *, num_heads, head_dim, max_len):
    return A.init_linformer_projections(key, max_len, hp.get("proj_len", 32))


def _linformer(q, k, v, ef, *, proj_len=None, key=None, **kw):
    return A.linformer_attention(q, k, v, *ef, **kw)


register_variant(Variant(
    "linformer", lifted(_linformer, arg_axes=(None,)), init=_linformer_init, causal=False,
    hyperparameters=frozenset({"proj_len"}),
))


def _nystrom_init(key, hp, *, num_heads, head_dim, max_len):
    return A.init_nystrom_conv(key, hp.get("kernel_size", 33))


def _nystrom(q, k, v, conv, *, kernel_size=None, key=None, **kw):
    return A.nystrom_attention(q, k, v, conv, **kw)


register_variant(Variant(
    "nystrom", lifted(_nystrom, arg_axes=(None,)), init=_nystrom_init, causal=False,
    hyperparameters=frozenset({"num_landmarks", "kernel_size", "pinv_iterations"}),
))


def _luna_init(key, hp, *, num_heads, head_dim, max_len):
    return A.init_luna_sequence(key, hp.get("length", 16), head_dim)


def _luna(q, k, v, p, *, length=None, key=None, **kw):
    return A.luna_attention(q, k, v, p, **kw)


register_variant(Variant(
    "luna", lifted(_luna, arg_axes=(None,)), init=_luna_init,
    hyperparameters=frozenset({"length", "chunk_size"}),
))


def _seeded(fn):
    """Clustered attention hashes with random planes: without a key, a fixed seed."""
    def call(q, k, v, *, seed=0, key=None, **kw):
        return fn(q, k, v, key=jax.random.key(seed) if key is None else key, **kw)
    return call


_CLUSTER_HP = frozenset({"num_clusters", "bits", "iterations", "seed"})
register_variant(Variant(
    "clustered", lifted(_seeded(A.clustered_attention)), causal=False,
    hyperparameters=_CLUSTER_HP,
))
register_variant(Variant(
    "improved_clustered", lifted(_seeded(A.improved_clustered_attention)), causal=False,
    hyperparameters=_CLUSTER_HP | {"topk"},
))


# --- learned sparsity (issue 6) ---------------------------------------------------------------

def _lsh_init(key, hp, *, num_heads, head_dim, max_len):
    return A.init_lsh_rotations(key, head_dim, hp.get("num_buckets", 4), hp.get("num_rounds", 1))


def _lsh(q, k, v, rotations, *, num_buckets=None, num_rounds=None, key=None, **kw):
    # Reformer's shared-QK attention: keys are the (normalised) queries.
    return A.lsh_attention(q, q, v, jax.lax.stop_gradient(rotations), **kw)


register_variant(Variant(
    "lsh", lifted(_lsh, arg_axes=(None,)), init=_lsh_init,
    hyperparameters=frozenset({"num_buckets", "num_rounds", "chunk_size"}),
))


def _sinkhorn_init(key, hp, *, num_heads, head_dim, max_len):
    return A.init_sinkhorn_sort_net(key, head_dim, -(-max_len // hp["block_size"]))


def _sinkhorn(q, k, v, net, **kw):
    return A.sinkhorn_attention(q, k, v, net, **kw)


register_variant(Variant(
    "sinkhorn", lifted(_sinkhorn, arg_axes=(None,)), init=_sinkhorn_init,
    hyperparameters=frozenset({"block_size", "temperature", "iterations", "hard", "sortcut"}),
))


def _no_key(fn):
    def call(q, k, v, *args, key=None, **kw):
        return fn(q, k, v, *args, **kw)
    return call


register_variant(Variant(
    "entmax", lifted(_no_key(A.entmax_attention)), hyperparameters=frozenset({"alpha", "n_iter"}),
))
register_variant(Variant(
    "topk", lifted(_no_key(A.topk_attention)), hyperparameters=frozenset({"top_k"}),
))


def _span_init(key, hp, *, num_heads, head_dim, max_len):
    return jnp.full((num_heads,), hp["max_span"] / 2, jnp.float32)


register_variant(Variant(
    "adaptive_span", lifted(_no_key(A.adaptive_span_attention), arg_axes=("heads",)),
    init=_span_init, hyperparameters=frozenset({"max_span", "ramp", "block_size"}),
))


def _dam_init(key, hp, *, num_heads, head_dim, max_len):
    return A.init_dam_logits(max_len)


register_variant(Variant(
    "dam", lifted(A.dam_attention, arg_axes=(None,)), init=_dam_init, causal=False,
    hyperparameters=frozenset({"temperature", "always_on_ends"}),
))


# --- more low-rank and compression kinds (issue 5, second batch) ------------------------------

def _params_fn(fn, drop=()):
    """Calls ``fn(q, k, v, *params, ...)`` with init-only hyperparameters ``drop`` removed."""
    def call(q, k, v, params, *, key=None, **kw):
        for name in drop:
            kw.pop(name, None)
        return fn(q, k, v, *params, **kw)
    return call


register_variant(Variant(
    "lowrank_band", lifted(_params_fn(A.lowrank_band_attention, ("rank",)), arg_axes=(None,)),
    init=lambda key, hp, **s: A.init_lowrank_band(key, s["head_dim"], hp.get("rank", 8)),
    hyperparameters=frozenset({"window", "rank", "lowrank_scale"}),
))
def _long_short(q, k, v, params, *, causal=False, segment_size=None, rank=None, key=None,
                **kw):
    # The segment size belongs to the causal (segment-wise) form only.
    seg = {"segment_size": segment_size} if causal else {}
    return A.long_short_attention(q, k, v, *params, causal=causal, **seg, **kw)


register_variant(Variant(
    "long_short", lifted(_long_short, arg_axes=(None,)),
    init=lambda key, hp, **s: (A.init_long_short_projection(key, s["head_dim"],
                                                            hp.get("rank", 8)),),
    hyperparameters=frozenset({"window", "rank", "segment_size"}),
))
register_variant(Variant(
    "memory_compressed",
    lifted(_params_fn(A.memory_compressed_attention, ("stride",)), arg_axes=(None,)),
    init=lambda key, hp, **s: A.init_memory_compression(key, hp.get("stride", 2), s["head_dim"],
                                                        s["head_dim"]),
    hyperparameters=frozenset({"block_size", "stride"}),
))
register_variant(Variant(
    "poolingformer", lifted(_no_key(A.poolingformer_attention)), causal=False,
    hyperparameters=frozenset({"window", "pool_size", "second_window", "pool"}),
))
register_variant(Variant(
    "probsparse", lifted(_seeded(A.probsparse_attention)), causal=False,
    hyperparameters=frozenset({"factor", "seed"}),
))


def _synthesizer_init(key, hp, *, num_heads, head_dim, max_len):
    forms = hp.get("forms", ("dense",))
    keys = jax.random.split(key, len(forms))
    return {f: A.init_synthesizer(k, f, head_dim, max_len, rank=hp.get("rank", 8))
            for f, k in zip(forms, keys)}


def _synthesizer(q, k, v, params, *, forms=None, rank=None, key=None, **kw):
    return A.synthesizer_attention(q, k, v, params, **kw)


register_variant(Variant(
    "synthesizer", lifted(_synthesizer, arg_axes=(None,)), init=_synthesizer_init,
    hyperparameters=frozenset({"forms", "rank"}),
))
