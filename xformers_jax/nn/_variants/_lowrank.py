"""Registry entries of the low-rank and compression family (:mod:`xformers_jax.attention.lowrank`).

Each entry says how the kind's own arrays are created from a key and which hyperparameters
only shape them (``init_only``). Not registered: the Funnel / TokenLearner down-sampling
functions (they change the sequence length, so they belong between blocks, not inside
attention).
"""

from __future__ import annotations

import jax

from ... import attention as A
from ...attention.lowrank._kinds import KINDS
from .._registry import Variant, lifted, register_variant

_KIND = {k.name: k for k in KINDS}


def _register(name, attend, **fields):
    register_variant(Variant.from_kind(_KIND[name], attend, **fields))


def _seeded(fn):
    """The ``attend`` of a kind that draws from a key (clustered attention's hyperplanes,
    ProbSparse's key sample) and computes statistics over queries (so it takes ``q_mask``).

    Given a ``key`` (training), every example and head draws its own, as dropout does. Without
    one (evaluation), each head draws from a fixed key of ``seed`` shared by the whole batch,
    so an example's output does not depend on the batch it comes in or on its row there.
    """
    per_example = lifted(fn, takes_q_mask=True)
    per_head = lifted(lambda q, k, v, head_key, **kw: fn(q, k, v, key=head_key, **kw),
                      ("heads",), takes_q_mask=True)

    def attend(q, k, v, params, *, key, seed=0, **kw):
        if key is not None:
            return per_example(q, k, v, params, key=key, **kw)
        heads = jax.random.split(jax.random.key(seed), q.shape[2])
        return per_head(q, k, v, heads, key=None, **kw)

    return attend


_register(
    "linformer", lifted(A.linformer_attention, (None,), unpack=True),
    init=lambda key, hp, *, max_len, **s: A.init_linformer_projections(
        key, max_len, hp.get("proj_len", 32)),
    hyperparameters={"proj_len"}, init_only={"proj_len"},
)
_register(
    "nystrom", lifted(A.nystrom_attention, (None,), takes_q_mask=True),
    init=lambda key, hp, **s: A.init_nystrom_conv(key, hp.get("kernel_size", 33)),
    hyperparameters={"num_landmarks", "kernel_size", "pinv_iterations"},
    init_only={"kernel_size"},
)
_register(
    "luna", lifted(A.luna_attention, (None,)),
    init=lambda key, hp, *, head_dim, **s: A.init_luna_sequence(key, hp.get("length", 16),
                                                                head_dim),
    hyperparameters={"length", "chunk_size"}, init_only={"length"},
)

_CLUSTER_HP = frozenset({"num_clusters", "bits", "iterations", "seed"})
_register("clustered", _seeded(A.clustered_attention), hyperparameters=_CLUSTER_HP)
_register("improved_clustered", _seeded(A.improved_clustered_attention),
          hyperparameters=_CLUSTER_HP | {"topk"})

_register(
    "lowrank_band", lifted(A.lowrank_band_attention, (None,), unpack=True),
    init=lambda key, hp, *, head_dim, **s: A.init_lowrank_band(key, head_dim, hp.get("rank", 8)),
    hyperparameters={"window", "rank", "lowrank_scale"}, init_only={"rank"},
)


def _long_short(q, k, v, w_p, *, causal=False, segment_size=None, **kw):
    # The segment size belongs to the causal (segment-wise) form only.
    seg = {"segment_size": segment_size} if causal else {}
    return A.long_short_attention(q, k, v, w_p, causal=causal, **seg, **kw)


_register(
    "long_short", lifted(_long_short, (None,), unpack=True),
    init=lambda key, hp, *, head_dim, **s: (A.init_long_short_projection(
        key, head_dim, hp.get("rank", 8)),),
    hyperparameters={"window", "rank", "segment_size"}, init_only={"rank"},
)
_register(
    "memory_compressed", lifted(A.memory_compressed_attention, (None,), unpack=True),
    init=lambda key, hp, *, head_dim, **s: A.init_memory_compression(
        key, hp.get("stride", 2), head_dim, head_dim),
    hyperparameters={"block_size", "stride"}, init_only={"stride"},
)
_register("poolingformer", lifted(A.poolingformer_attention),
          hyperparameters={"window", "pool_size", "second_window", "pool"})
_register("probsparse", _seeded(A.probsparse_attention),
          hyperparameters={"factor", "seed"})


def _synthesizer_init(key, hp, *, num_heads, head_dim, max_len):
    forms = hp.get("forms", ("dense",))
    keys = jax.random.split(key, len(forms))
    return {f: A.init_synthesizer(k, f, head_dim, max_len, rank=hp.get("rank", 8))
            for f, k in zip(forms, keys)}


_register("synthesizer", lifted(A.synthesizer_attention, (None,)), init=_synthesizer_init,
          hyperparameters={"forms", "rank"}, init_only={"forms", "rank"})
