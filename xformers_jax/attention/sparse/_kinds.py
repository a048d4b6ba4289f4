"""Metadata of the fixed-pattern sparse kinds (see :mod:`.._kind`)."""

from __future__ import annotations

from .._kind import Kind, Paper
from ._axial import axial_attention
from ._global_tokens import etc_attention, longformer_attention
from ._per_head import per_head_block_sparse_attention

KINDS = (
    Kind("per_head_block_sparse", per_head_block_sparse_attention, "sparse",
         Paper("Child et al.", 2019, "Generating Long Sequences with Sparse Transformers"),
         time="O(L sqrt(L) D) (strided heads)", memory="O(L D)", causal=True,
         test_hyperparameters={"stride": 4, "block_q": 8, "block_k": 8}),
    Kind("axial", axial_attention, "sparse",
         Paper("Ho et al.", 2019, "Axial Attention in Multidimensional Transformers"),
         time="O(L s D), s the attended axis' size", memory="O(L D)", causal=True,
         fixed_length=True, test_hyperparameters={"shape": (4, 4)}),
    Kind("longformer", longformer_attention, "sparse",
         Paper("Beltagy et al.", 2020, "Longformer: The Long-Document Transformer"),
         time="O(L (w + G) D)", memory="O(L D)", causal=True,
         test_hyperparameters={"window": 2, "global_tokens": (0,), "block_q": 8, "block_k": 8}),
    Kind("etc", etc_attention, "sparse",
         Paper("Ainslie et al.", 2020,
               "ETC: Encoding Long and Structured Inputs in Transformers"),
         time="O(L (r + G) D)", memory="O(L D)", causal=False,
         test_hyperparameters={"num_global": 2, "radius": 2, "block_q": 8, "block_k": 8}),
)
