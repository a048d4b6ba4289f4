"""Metadata of the low-rank and compression kinds (see :mod:`.._kind`)."""

from __future__ import annotations

from .._kind import Kind, Paper
from ._clustered import clustered_attention, improved_clustered_attention
from ._linformer import linformer_attention
from ._long_short import long_short_attention
from ._lowrank_band import lowrank_band_attention
from ._luna import luna_attention
from ._memory_compressed import memory_compressed_attention
from ._nystrom import nystrom_attention
from ._poolingformer import poolingformer_attention
from ._probsparse import probsparse_attention
from ._synthesizer import synthesizer_attention

_VYAS = Paper("Vyas et al.", 2020, "Fast Transformers with Clustered Attention")

KINDS = (
    Kind("linformer", linformer_attention, "lowrank",
         Paper("Wang et al.", 2020, "Linformer: Self-Attention with Linear Complexity"),
         time="O(L k D), k the projected length", memory="O(L k)", causal=False,
         fixed_length=True, test_hyperparameters={"proj_len": 8}),
    Kind("nystrom", nystrom_attention, "lowrank",
         Paper("Xiong et al.", 2021,
               "Nystromformer: A Nystrom-Based Algorithm for Approximating Self-Attention"),
         time="O(L m D), m landmarks", memory="O(L m)", causal=False,
         test_hyperparameters={"num_landmarks": 4, "kernel_size": 3}),
    Kind("luna", luna_attention, "lowrank",
         Paper("Ma et al.", 2021, "Luna: Linear Unified Nested Attention"),
         time="O(L l D), l packed rows", memory="O(L l)", causal=True,
         test_hyperparameters={"length": 4, "chunk_size": 8}),
    Kind("clustered", clustered_attention, "lowrank", _VYAS,
         time="O(L C D), C clusters", memory="O(L C)", causal=False,
         test_hyperparameters={"num_clusters": 4}),
    Kind("improved_clustered", improved_clustered_attention, "lowrank", _VYAS,
         time="O(L (C + k) D), k top keys", memory="O(L (C + k))", causal=False,
         test_hyperparameters={"num_clusters": 4, "topk": 4}),
    Kind("lowrank_band", lowrank_band_attention, "lowrank",
         Paper("Guo et al.", 2019,
               "Low-Rank and Locality Constrained Self-Attention for Sequence Modeling"),
         time="O(L^2 r + L w D)", memory="O(L D)", causal=True,
         test_hyperparameters={"window": 3, "rank": 4}),
    Kind("long_short", long_short_attention, "lowrank",
         Paper("Zhu et al.", 2021,
               "Long-Short Transformer: Efficient Transformers for Language and Vision"),
         time="O(L (w + r) D)", memory="O(L (w + r))", causal=True,
         test_hyperparameters={"window": 3, "rank": 4, "segment_size": 4}),
    Kind("memory_compressed", memory_compressed_attention, "lowrank",
         Paper("Liu et al.", 2018, "Generating Wikipedia by Summarizing Long Sequences"),
         time="O(L (b + L/c) D)", memory="O(L (b + L/c))", causal=True,
         test_hyperparameters={"block_size": 4, "stride": 2}),
    Kind("poolingformer", poolingformer_attention, "lowrank",
         Paper("Zhang et al.", 2021,
               "Poolingformer: Long Document Modeling with Pooling Attention"),
         time="O(L (w + L/p) D)", memory="O(L (w + L/p))", causal=False,
         test_hyperparameters={"window": 3, "pool_size": 4}),
    Kind("probsparse", probsparse_attention, "lowrank",
         Paper("Zhou et al.", 2021,
               "Informer: Beyond Efficient Transformer for Long Sequence Time-Series "
               "Forecasting"),
         time="O(L log L D)", memory="O(L log L)", causal=False,
         test_hyperparameters={"factor": 1.0}),
    Kind("synthesizer", synthesizer_attention, "lowrank",
         Paper("Tay et al.", 2021,
               "Synthesizer: Rethinking Self-Attention for Transformer Models"),
         time="O(L^2 D)", memory="O(L^2)", causal=True, fixed_length=True,
         test_hyperparameters={"forms": ("dense", "factorized_random"), "rank": 4}),
)
