"""Attention with priors and multi-head variants: Gaussian locality priors (Yang et al.; Guo
et al.), hard-coded Gaussian attention, the average attention network, priors from the layer
below (Realformer, Predictive attention, Lazyformer), talking heads, collaborative heads,
multi-scale heads, the disagreement regularisers and routing-by-agreement aggregation of
head outputs.

Every public name here is also exported by ``xformers_jax.attention``.
"""

from ._average import AverageGate as AverageGate
from ._average import AverageState as AverageState
from ._average import average_attention as average_attention
from ._average import average_attention_init_state as average_attention_init_state
from ._average import average_attention_step as average_attention_step
from ._average import init_average_gate as init_average_gate
from ._collaborative import collaborative_attention as collaborative_attention
from ._collaborative import collaborative_mixing_from_heads as collaborative_mixing_from_heads
from ._cross_layer import attention_weights as attention_weights
from ._cross_layer import init_predictive_conv as init_predictive_conv
from ._cross_layer import lazy_attention as lazy_attention
from ._cross_layer import predictive_attention as predictive_attention
from ._cross_layer import predictive_conv as predictive_conv
from ._cross_layer import realformer_attention as realformer_attention
from ._cross_layer import realformer_flash_attention as realformer_flash_attention
from ._disagreement import Disagreement as Disagreement
from ._disagreement import disagreement as disagreement
from ._gaussian import distance_prior_attention as distance_prior_attention
from ._gaussian import gaussian_prior_attention as gaussian_prior_attention
from ._gaussian import hardcoded_gaussian_attention as hardcoded_gaussian_attention
from ._gaussian import init_gaussian_window as init_gaussian_window
from ._gaussian import predict_gaussian_window as predict_gaussian_window
from ._multiscale import multiscale_attention as multiscale_attention
from ._multiscale import multiscale_patterns as multiscale_patterns
from ._routing_aggregation import init_routing_votes as init_routing_votes
from ._routing_aggregation import routing_aggregation as routing_aggregation
from ._routing_aggregation import squash as squash
from ._talking import talking_heads_attention as talking_heads_attention
