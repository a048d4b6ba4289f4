"""Metadata of the prior and multi-head kinds (see :mod:`.._kind`).

Realformer, Predictive attention and Lazyformer pass scores between layers
(:mod:`._cross_layer`): their module-side entries carry them from layer to layer through the
layer stack (``nn.Variant.layer_carry``). Predictive attention and Lazyformer need the previous
layer's attention map itself and are dense-score kinds; Realformer's residual scores have an
exact tiled form."""

from __future__ import annotations

from .._kind import Kind, Paper
from ._average import average_attention
from ._collaborative import collaborative_attention
from ._cross_layer import lazy_attention, predictive_attention, realformer_attention
from ._gaussian import (distance_prior_attention, gaussian_prior_attention,
                        hardcoded_gaussian_attention)
from ._multiscale import multiscale_attention
from ._talking import talking_heads_attention

KINDS = (
    Kind("gaussian_prior", gaussian_prior_attention, "priors",
         Paper("Yang et al.", 2018, "Modeling Localness for Self-Attention Networks"),
         time="O(L^2 D)", memory="O(L)", causal=True, test_hyperparameters={}),
    Kind("distance_prior", distance_prior_attention, "priors",
         Paper("Guo et al.", 2019,
               "Gaussian Transformer: a Lightweight Approach for Natural Language Inference"),
         time="O(L^2 D)", memory="O(L)", causal=True, test_hyperparameters={}),
    Kind("hardcoded_gaussian", hardcoded_gaussian_attention, "priors",
         Paper("You et al.", 2020, "Hard-Coded Gaussian Attention for Neural Machine "
               "Translation"),
         time="O(L^2 D)", memory="O(L)", causal=True,
         test_hyperparameters={"offset": 0.0, "std": 1.0}),
    Kind("average", average_attention, "priors",
         Paper("Zhang et al.", 2018, "Accelerating Neural Transformer via an Average Attention "
               "Network"),
         time="O(L D^2)", memory="O(L D)", causal=True, decoding="recurrent",
         test_hyperparameters={}),
    Kind("talking_heads", talking_heads_attention, "priors",
         Paper("Shazeer et al.", 2020, "Talking-Heads Attention"),
         time="O(L^2 H^2 D) tiled, O(L^2 H (D + H)) dense", memory="O(L H^2 D) tiled, "
         "O(H L^2) dense", causal=True, test_hyperparameters={"implementation": "tiled"}),
    Kind("collaborative", collaborative_attention, "priors",
         Paper("Cordonnier et al.", 2020, "Multi-Head Attention: Collaborate Instead of "
               "Concatenate"),
         time="O(L^2 H Dq)", memory="O(L)", causal=True, test_hyperparameters={}),
    Kind("multiscale", multiscale_attention, "priors",
         Paper("Guo et al.", 2020, "Multi-Scale Self-Attention for Text Classification"),
         time="O(L sum_h w_h D)", memory="O(L max_h w_h)", causal=True,
         test_hyperparameters={"spans": (2, None)}),
    Kind("realformer", realformer_attention, "priors",
         Paper("He et al.", 2021, "RealFormer: Transformer Likes Residual Attention"),
         time="O(L^2 D) dense, O(L^2 n D) tiled at layer n", memory="O(H L^2) dense, "
         "O(n L D) tiled", causal=True, test_hyperparameters={}),
    Kind("predictive", predictive_attention, "priors",
         Paper("Wang et al.", 2021, "Predictive Attention Transformer: Improving Transformer "
               "with Attention Map Prediction"),
         time="O(L^2 (D + 9 H))", memory="O(H L^2) (dense scores)", causal=True,
         test_hyperparameters={"alpha": 0.5}),
    Kind("lazy", lazy_attention, "priors",
         Paper("Ying et al.", 2021, "LazyFormer: Self Attention with Lazy Update"),
         time="O(L^2 D), the map every k layers", memory="O(H L^2) (dense scores)",
         causal=True, test_hyperparameters={"every": 2}),
)
