"""The low-rank and compression kinds as :class:`~xformers_jax.kinds.Kind` records, with their
adapters: how each kind's own arrays are created from a key and which hyperparameters only shape
them (``init_only``). Not kinds: the Funnel / TokenLearner down-sampling functions (they change
the sequence length, so they belong between blocks, not inside attention).
"""

from __future__ import annotations

import jax

from ... import axes as X
from ...kinds import REQUIRED, AttentionAdapter, Kind, Paper
from .._adapters import lifted
from ._clustered import clustered_attention, improved_clustered_attention
from ._linformer import init_linformer_projections, linformer_attention
from ._long_short import init_long_short_projection, long_short_attention
from ._lowrank_band import init_lowrank_band, lowrank_band_attention
from ._luna import init_luna_sequence, luna_attention
from ._memory_compressed import init_memory_compression, memory_compressed_attention
from ._nystrom import init_nystrom_conv, nystrom_attention
from ._poolingformer import poolingformer_attention
from ._probsparse import probsparse_attention
from ._synthesizer import init_synthesizer, synthesizer_attention

_VYAS = Paper("Vyas et al.", 2020, "Fast Transformers with Clustered Attention")


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


def _long_short(q, k, v, w_p, *, causal=False, segment_size=None, **kw):
    # The segment size belongs to the causal (segment-wise) form only.
    seg = {"segment_size": segment_size} if causal else {}
    return long_short_attention(q, k, v, w_p, causal=causal, **seg, **kw)


def _synthesizer_init(key, hp, *, num_heads, head_dim, max_len):
    keys = jax.random.split(key, len(hp["forms"]))
    # The fixed random form's logits are never trained (Tay et al.): a buffer.
    params = {f: init_synthesizer(k, f, head_dim, max_len, rank=hp["rank"])
              for f, k in zip(hp["forms"], keys)}
    return {f: X.Buffer(p) if f == "fixed_random" else p for f, p in params.items()}


_CLUSTERS = {
    "num_clusters": (REQUIRED, "clusters C of the queries (C <= L)"),
    "bits": (32, "LSH code length of the Hamming k-means"),
    "iterations": (10, "Lloyd iterations of the Hamming k-means"),
    "seed": (0, "seed of the per-head draws in evaluation (no key)"),
}

KINDS = (
    Kind("linformer", linformer_attention, "lowrank",
         Paper("Wang et al.", 2020, "Linformer: Self-Attention with Linear Complexity"),
         time="O(L k D), k the projected length", memory="O(L k)", causal=False,
         fixed_length=True,
         segments=lambda hp: (
             "its projections E and F mix the whole length axis of the row, so every "
             "document's keys depend on the others; train it on unpacked rows "
             "(data.pack=False)"),
         test_hyperparameters={"proj_len": 8},
         hyperparameters={"proj_len": (32, "the projected length k of keys and values")},
         adapter=AttentionAdapter(
             lifted(linformer_attention, (None,), unpack=True),
             init=lambda key, hp, *, max_len, **s: init_linformer_projections(
                 key, max_len, hp["proj_len"]),
             init_only={"proj_len"})),
    Kind("nystrom", nystrom_attention, "lowrank",
         Paper("Xiong et al.", 2021,
               "Nystromformer: A Nystrom-Based Algorithm for Approximating Self-Attention"),
         time="O(L m D), m landmarks", memory="O(L m)", causal=False,
         segments=lambda hp: (
             "its landmarks are means over segments of the whole row, which straddle "
             "documents, so a document's attention depends on the others; "
             "train it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"num_landmarks": 4, "kernel_size": 3},
         hyperparameters={
             "num_landmarks": (REQUIRED, "landmarks m (segment means of queries and keys)"),
             "kernel_size": (33, "width of the depthwise convolution skip on the values (odd)"),
             "pinv_iterations": (6, "iterations of the iterative pseudo-inverse")},
         adapter=AttentionAdapter(
             lifted(nystrom_attention, (None,), takes_q_mask=True),
             init=lambda key, hp, **s: init_nystrom_conv(key, hp["kernel_size"]),
             init_only={"kernel_size"})),
    Kind("luna", luna_attention, "lowrank",
         Paper("Ma et al.", 2021, "Luna: Linear Unified Nested Attention"),
         time="O(L l D), l packed rows", memory="O(L l)", causal=True,
         segments=lambda hp: (
             "its packed sequence attends over every earlier token of the row (causal: a "
             "running pack), so a document's outputs depend on the documents before it; train "
             "it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"length": 4, "chunk_size": 8},
         hyperparameters={
             "length": (16, "rows l of the learned packing sequence"),
             "chunk_size": (64, "positions per step of the causal form")},
         adapter=AttentionAdapter(
             lifted(luna_attention, (None,)),
             init=lambda key, hp, *, head_dim, **s: init_luna_sequence(key, hp["length"],
                                                                       head_dim),
             init_only={"length"})),
    Kind("clustered", clustered_attention, "lowrank", _VYAS,
         time="O(L C D), C clusters", memory="O(L C)", causal=False,
         segments=lambda hp: (
             "it clusters the queries of the whole row, so a query's centroid (and so "
             "its output) depends on the other documents; "
             "train it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"num_clusters": 4}, hyperparameters=_CLUSTERS,
         adapter=AttentionAdapter(_seeded(clustered_attention))),
    Kind("improved_clustered", improved_clustered_attention, "lowrank", _VYAS,
         time="O(L (C + k) D), k top keys", memory="O(L (C + k))", causal=False,
         segments=lambda hp: (
             "it clusters the queries of the whole row, so a query's centroid and top "
             "keys depend on the other documents; train it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"num_clusters": 4, "topk": 4},
         hyperparameters={**_CLUSTERS,
                          "topk": (REQUIRED, "keys k each cluster attends to exactly")},
         adapter=AttentionAdapter(_seeded(improved_clustered_attention))),
    Kind("lowrank_band", lowrank_band_attention, "lowrank",
         Paper("Guo et al.", 2019,
               "Low-Rank and Locality Constrained Self-Attention for Sequence Modeling"),
         time="O(L^2 r + L w D)", memory="O(L D)", causal=True, segments=True,
         test_hyperparameters={"window": 3, "rank": 4},
         hyperparameters={
             "window": (REQUIRED, "band half-width (causal: how far back)"),
             "rank": (8, "rank r of the low-rank branch's projections"),
             "lowrank_scale": (None, "low-rank score scale (None: 1/sqrt(r))")},
         adapter=AttentionAdapter(
             lifted(lowrank_band_attention, (None,), unpack=True),
             init=lambda key, hp, *, head_dim, **s: init_lowrank_band(key, head_dim,
                                                                      hp["rank"]),
             init_only={"rank"})),
    Kind("long_short", long_short_attention, "lowrank",
         Paper("Zhu et al.", 2021,
               "Long-Short Transformer: Efficient Transformers for Language and Vision"),
         time="O(L (w + r) D)", memory="O(L (w + r))", causal=True,
         segments=lambda hp: (
             "its dynamic projection pools keys over "
             + ("the whole row" if hp["segment_size"] is None else
                f"segments of {hp['segment_size']} positions of the row")
             + ", across document boundaries, so a document's long-range keys "
             "depend on its neighbours and on its offset; train it on unpacked rows "
             "(data.pack=False)"),
         test_hyperparameters={"window": 3, "rank": 4, "segment_size": 4},
         hyperparameters={
             "window": (REQUIRED, "sliding window half-width (causal: width back)"),
             "rank": (8, "rank r of the dynamic projection"),
             "segment_size": (None, "tokens per projected segment (the causal form needs it)")},
         adapter=AttentionAdapter(
             lifted(_long_short, (None,), unpack=True),
             init=lambda key, hp, *, head_dim, **s: (init_long_short_projection(
                 key, head_dim, hp["rank"]),),
             init_only={"rank"})),
    Kind("memory_compressed", memory_compressed_attention, "lowrank",
         Paper("Liu et al.", 2018, "Generating Wikipedia by Summarizing Long Sequences"),
         time="O(L (b + L/c) D)", memory="O(L (b + L/c))", causal=True,
         segments=lambda hp: (
             f"its strided convolution compresses every {hp['stride']} keys of the row into "
             f"one, and its local blocks of {hp['block_size']} are blocks of the row: both "
             "straddle documents, so a document's keys depend on its neighbours and on its "
             "offset; train it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"block_size": 4, "stride": 2},
         hyperparameters={
             "block_size": (REQUIRED, "length of the contiguous local blocks"),
             "stride": (2, "compression stride c of the strided convolutions")},
         adapter=AttentionAdapter(
             lifted(memory_compressed_attention, (None,), unpack=True),
             init=lambda key, hp, *, head_dim, **s: init_memory_compression(
                 key, hp["stride"], head_dim, head_dim),
             init_only={"stride"})),
    Kind("poolingformer", poolingformer_attention, "lowrank",
         Paper("Zhang et al.", 2021,
               "Poolingformer: Long Document Modeling with Pooling Attention"),
         time="O(L (w + L/p) D)", memory="O(L (w + L/p))", causal=False,
         segments=lambda hp: (
             "its second level pools keys over windows of the row, which straddle "
             "documents, so a document's pooled memory depends on its neighbours; "
             "train it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"window": 3, "pool_size": 4},
         hyperparameters={
             "window": (REQUIRED, "first-level half-width: query i sees |i - j| <= window"),
             "pool_size": (REQUIRED, "tokens per pooled memory slot (kernel = stride)"),
             "second_window": (None, "second-level half-width over the slots (None: all)"),
             "pool": ("mean", "pooling of the slots: 'mean' or 'max'")},
         adapter=AttentionAdapter(lifted(poolingformer_attention))),
    Kind("probsparse", probsparse_attention, "lowrank",
         Paper("Zhou et al.", 2021,
               "Informer: Beyond Efficient Transformer for Long Sequence Time-Series "
               "Forecasting"),
         time="O(L log L D)", memory="O(L log L)", causal=False,
         segments=lambda hp: (
             "it ranks the queries of the whole row (and samples keys from it) to choose "
             "which queries attend, so a document's outputs depend on the others; "
             "train it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"factor": 1.0},
         hyperparameters={
             "factor": (5.0, "Informer's sampling factor c (c ln L queries and keys)"),
             "seed": (0, "seed of the per-head draws in evaluation (no key)")},
         adapter=AttentionAdapter(_seeded(probsparse_attention))),
    Kind("synthesizer", synthesizer_attention, "lowrank",
         Paper("Tay et al.", 2021,
               "Synthesizer: Rethinking Self-Attention for Transformer Models"),
         time="O(L^2 D)", memory="O(L^2)", causal=True, fixed_length=True,
         segments=lambda hp: (
             f"its synthesized weights {tuple(hp['forms'])} are indexed by absolute positions "
             "of the row (a token's logits over max_len positions, or a learned [max_len, "
             "max_len] table), so a document packed at an offset gets other weights than "
             "alone; train it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"forms": ("dense", "factorized_random"), "rank": 4},
         hyperparameters={
             "forms": (("dense",), "the synthesizer forms mixed, e.g. ('dense', 'random')"),
             "rank": (8, "rank of the factorized forms")},
         adapter=AttentionAdapter(lifted(synthesizer_attention, (None,)),
                                  init=_synthesizer_init, init_only={"forms", "rank"})),
)
