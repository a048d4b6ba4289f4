"""Metadata of the learned and content-based sparsity kinds (see :mod:`.._kind`)."""

from __future__ import annotations

from .._kind import Kind, Paper
from ._adaptive_span import adaptive_span_attention
from ._dam import dam_attention
from ._entmax import entmax_attention
from ._lsh import lsh_attention
from ._routing import routing_attention
from ._sinkhorn import sinkhorn_attention
from ._topk import topk_attention

KINDS = (
    Kind("lsh", lsh_attention, "learned",
         Paper("Kitaev et al.", 2020, "Reformer: The Efficient Transformer"),
         time="O(n L (c + log L) D), n rounds, c chunk", memory="O(n L c)", causal=True,
         test_hyperparameters={"num_buckets": 4, "chunk_size": 4}),
    Kind("sinkhorn", sinkhorn_attention, "learned",
         Paper("Tay et al.", 2020, "Sparse Sinkhorn Attention"),
         time="O(L b D + (L/b)^2), b the block", memory="O(L b + (L/b)^2)", causal=True,
         fixed_length=True, test_hyperparameters={"block_size": 4}),
    Kind("entmax", entmax_attention, "learned",
         Paper("Correia et al.", 2019, "Adaptively Sparse Transformers"),
         time="O(L^2 D)", memory="O(L^2)", causal=True, test_hyperparameters={}),
    Kind("topk", topk_attention, "learned",
         Paper("Gupta et al.", 2021, "Memory-efficient Transformers via Top-k Attention"),
         time="O(L^2 D)", memory="O(L^2)", causal=True, test_hyperparameters={"top_k": 4}),
    Kind("adaptive_span", adaptive_span_attention, "learned",
         Paper("Sukhbaatar et al.", 2019, "Adaptive Attention Span in Transformers"),
         time="O(L (S + R) D), S the maximum span", memory="O(L (S + R))", causal=True,
         test_hyperparameters={"max_span": 8, "ramp": 2}),
    Kind("dam", dam_attention, "learned",
         Paper("Shi et al.", 2021,
               "SparseBERT: Rethinking the Importance Analysis in Self-attention"),
         time="O(L^2 D)", memory="O(L^2)", causal=False, fixed_length=True,
         test_hyperparameters={}),
    Kind("routing", routing_attention, "learned",
         Paper("Roy et al.", 2021,
               "Efficient Content-Based Sparse Attention with Routing Transformers"),
         time="O(L w D + L K D), w the cluster window", memory="O(L w)", causal=True,
         test_hyperparameters={"num_clusters": 2, "window": 4}),
)
