"""Metadata of the kernelized linear kinds (see :mod:`.._kind`)."""

from __future__ import annotations

from .._kind import Kind, Paper
from ._delta import delta_rule_attention
from ._linear import linear_attention, performer_attention

KINDS = (
    Kind("linear", linear_attention, "linear",
         Paper("Katharopoulos et al.", 2020,
               "Transformers are RNNs: Fast Autoregressive Transformers with Linear Attention"),
         time="O(L D^2)", memory="O(L D + (L/c) D^2)", causal=True, decoding="recurrent",
         test_hyperparameters={"chunk_size": 8}),
    Kind("performer", performer_attention, "linear",
         Paper("Choromanski et al.", 2021, "Rethinking Attention with Performers"),
         time="O(L m D), m random features", memory="O(L m + (L/c) m D)", causal=True,
         decoding="recurrent", test_hyperparameters={"num_features": 16, "chunk_size": 8}),
    Kind("delta_rule", delta_rule_attention, "linear",
         Paper("Schlag et al.", 2021, "Linear Transformers Are Secretly Fast Weight Programmers"),
         time="O(L M D), M features", memory="O(L M + (L/c) M D)", causal=True,
         decoding="recurrent", test_hyperparameters={"chunk_size": 8}),
)
