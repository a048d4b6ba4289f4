"""Kernelized / linear attention: feature maps, linear attention with the one chunked causal
scan, the delta rule, O(1) decoding states.

The scan itself is public: every recurrence of the library runs on it (linear attention, the
gated recurrences and state space models of ``xformers_jax.mixers``), in its per-step
(``causal_step``, ``causal_recurrent``), chunkwise-parallel (``causal_chunked``) and parallel
(``causal_parallel``) forms; the delta rule's forms (``gated_delta_*``) add its chunked
triangular solve, and the generalised (diagonal-plus-rank-one) delta rule's forms
(``dplr_*``) its per-channel decays; log-linear attention's forms (``loglinear_*``, Guo et al.
2025) keep a Fenwick-tree hierarchy of its states, each read with its own level weight. Every public name here is also exported by
``xformers_jax.attention``.
"""

from ._delta import delta_rule_attention as delta_rule_attention
from ._delta import delta_rule_init_state as delta_rule_init_state
from ._delta import delta_rule_step as delta_rule_step
from ._delta import gated_delta_chunked as gated_delta_chunked
from ._delta import gated_delta_recurrent as gated_delta_recurrent
from ._delta import gated_delta_step as gated_delta_step
from ._dplr import dplr_chunked as dplr_chunked
from ._dplr import dplr_recurrent as dplr_recurrent
from ._dplr import dplr_step as dplr_step
from ._feature_maps import dpfp_features as dpfp_features
from ._feature_maps import elu_features as elu_features
from ._feature_maps import favor_positive_features as favor_positive_features
from ._feature_maps import favor_trig_features as favor_trig_features
from ._feature_maps import hyperbolic_features as hyperbolic_features
from ._feature_maps import init_random_projection as init_random_projection
from ._feature_maps import init_rfa_projection as init_rfa_projection
from ._feature_maps import relu_features as relu_features
from ._feature_maps import rfa_features as rfa_features
from ._feature_maps import taylor_features as taylor_features
from ._linear import LinearAttentionState as LinearAttentionState
from ._linear import linear_attention as linear_attention
from ._linear import linear_attention_init_state as linear_attention_init_state
from ._linear import linear_attention_step as linear_attention_step
from ._linear import performer_attention as performer_attention
from ._loglinear import fenwick_levels as fenwick_levels
from ._loglinear import loglinear_chunked as loglinear_chunked
from ._loglinear import loglinear_parallel as loglinear_parallel
from ._loglinear import loglinear_recurrent as loglinear_recurrent
from ._loglinear import loglinear_step as loglinear_step
from ._loglinear import num_levels as num_levels
from ._scan import causal_chunked as causal_chunked
from ._scan import causal_parallel as causal_parallel
from ._scan import causal_recurrent as causal_recurrent
from ._scan import causal_step as causal_step
from ._sequence_parallel import (
    sequence_parallel_linear_attention as sequence_parallel_linear_attention)
