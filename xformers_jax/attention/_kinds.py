"""Metadata of the exact softmax kinds (see :mod:`._kind`)."""

from __future__ import annotations

from . import patterns as P
from ._dense import dot_product_attention
from ._exact import block_sparse_attention, flash_attention
from ._kind import Kind, Paper

_VASWANI = Paper("Vaswani et al.", 2017, "Attention Is All You Need")
_CHILD = Paper("Child et al.", 2019, "Generating Long Sequences with Sparse Transformers")

KINDS = (
    Kind("dot_product", dot_product_attention, "exact", _VASWANI,
         time="O(L^2 D)", memory="O(L^2)", causal=True, decoding="kv", bias=True,
         test_hyperparameters={}),
    Kind("flash", flash_attention, "exact",
         Paper("Dao et al.", 2022,
               "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness"),
         time="O(L^2 D)", memory="O(L D)", causal=True, decoding="kv", bias=True,
         test_hyperparameters={"block_q": 8, "block_k": 8}),
    Kind("block_sparse", block_sparse_attention, "exact", _CHILD,
         time="O(L n D), n kept keys per query", memory="O(L D)", causal=True, decoding="kv",
         bias=True, test_hyperparameters={"pattern": P.Local(4, 4), "block_q": 8, "block_k": 8}),
    Kind("local", block_sparse_attention, "exact",
         Paper("Parmar et al.", 2018, "Image Transformer"),
         time="O(L w D), w the window", memory="O(L D)", causal=True, decoding="window",
         bias=True, test_hyperparameters={"left": 3}),
)
