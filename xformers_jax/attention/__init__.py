"""Attention variants as pure functions over one sequence and one head.

The contract (see ``_contract``): ``variant(q [Lq, Dk], k [Lk, Dk], v [Lk, Dv], *arrays,
causal=False, kv_mask=None, scale=None, key=None, **hyperparameters) -> [Lq, Dv]``. Lift any
variant to ``[batch, length, heads, dim]`` with :func:`multihead`.

:data:`KINDS` holds every attention kind as a :class:`xformers_jax.kinds.Kind` record (its
function, paper, cost, hyperparameters and the adapter ``nn.MultiHeadAttention`` runs), family by
family; each family declares its records in its ``_kinds.py``.
"""

from . import patterns as patterns
from ._dense import dot_product_attention as dot_product_attention
from ._exact import block_sparse_attention as block_sparse_attention
from ._exact import flash_attention as flash_attention
from ._exact import pattern_tile as pattern_tile
from ._flex import alibi_score as alibi_score
from ._flex import document_offsets as document_offsets
from ._flex import flex_attention as flex_attention
from ._flex import prefix_lm_mask as prefix_lm_mask
from ._flex import relative_bias_score as relative_bias_score
from ._flex import soft_cap_score as soft_cap_score
from ._flex import streaming_mask as streaming_mask
from ._multihead import multihead as multihead
from ._halo import halo_local_attention as halo_local_attention
from ._ring import ring_attention as ring_attention
from .sparse import axial_attention as axial_attention
from .sparse import axial_shift as axial_shift
from .sparse import etc_attention as etc_attention
from .sparse import longformer_attention as longformer_attention
from .sparse import per_head_block_sparse_attention as per_head_block_sparse_attention
from .linear import delta_rule_attention as delta_rule_attention
from .linear import delta_rule_init_state as delta_rule_init_state
from .linear import delta_rule_step as delta_rule_step
from .linear import dplr_chunked as dplr_chunked
from .linear import dplr_recurrent as dplr_recurrent
from .linear import dplr_step as dplr_step
from .linear import dpfp_features as dpfp_features
from .linear import elu_features as elu_features
from .linear import favor_positive_features as favor_positive_features
from .linear import favor_trig_features as favor_trig_features
from .linear import hyperbolic_features as hyperbolic_features
from .linear import init_random_projection as init_random_projection
from .linear import init_rfa_projection as init_rfa_projection
from .linear import linear_attention as linear_attention
from .linear import linear_attention_init_state as linear_attention_init_state
from .linear import linear_attention_step as linear_attention_step
from .linear import LinearAttentionState as LinearAttentionState
from .linear import causal_chunked as causal_chunked
from .linear import causal_parallel as causal_parallel
from .linear import causal_recurrent as causal_recurrent
from .linear import causal_step as causal_step
from .linear import gated_delta_chunked as gated_delta_chunked
from .linear import gated_delta_recurrent as gated_delta_recurrent
from .linear import gated_delta_step as gated_delta_step
from .linear import performer_attention as performer_attention
from .linear import fenwick_levels as fenwick_levels
from .linear import loglinear_chunked as loglinear_chunked
from .linear import loglinear_parallel as loglinear_parallel
from .linear import loglinear_recurrent as loglinear_recurrent
from .linear import loglinear_step as loglinear_step
from .linear import num_levels as num_levels
from .linear import relu_features as relu_features
from .linear import rfa_features as rfa_features
from .linear import taylor_features as taylor_features
from .linear import (
    sequence_parallel_linear_attention as sequence_parallel_linear_attention)
from .lowrank import clustered_attention as clustered_attention
from .lowrank import funnel_attention as funnel_attention
from .lowrank import funnel_pool as funnel_pool
from .lowrank import funnel_upsample as funnel_upsample
from .lowrank import improved_clustered_attention as improved_clustered_attention
from .lowrank import init_linformer_projections as init_linformer_projections
from .lowrank import init_long_short_projection as init_long_short_projection
from .lowrank import init_lowrank_band as init_lowrank_band
from .lowrank import init_luna_sequence as init_luna_sequence
from .lowrank import init_memory_compression as init_memory_compression
from .lowrank import init_nystrom_conv as init_nystrom_conv
from .lowrank import init_synthesizer as init_synthesizer
from .lowrank import init_token_learner as init_token_learner
from .lowrank import linformer_attention as linformer_attention
from .lowrank import long_short_attention as long_short_attention
from .lowrank import lowrank_band_attention as lowrank_band_attention
from .lowrank import luna_attention as luna_attention
from .lowrank import memory_compressed_attention as memory_compressed_attention
from .lowrank import nystrom_attention as nystrom_attention
from .lowrank import poolingformer_attention as poolingformer_attention
from .lowrank import probsparse_attention as probsparse_attention
from .lowrank import synthesizer_attention as synthesizer_attention
from .lowrank import token_learner as token_learner
from .learned import assign_clusters as assign_clusters
from .learned import cluster_chunk_attention as cluster_chunk_attention
from .learned import kmeans_centroids as kmeans_centroids
from .learned import adaptive_span_attention as adaptive_span_attention
from .learned import adaptive_span_penalty as adaptive_span_penalty
from .learned import dam_attention as dam_attention
from .learned import dam_mask as dam_mask
from .learned import dam_penalty as dam_penalty
from .learned import entmax15 as entmax15
from .learned import entmax_alpha as entmax_alpha
from .learned import entmax_attention as entmax_attention
from .learned import entmax_bisect as entmax_bisect
from .learned import init_dam_logits as init_dam_logits
from .learned import init_lsh_rotations as init_lsh_rotations
from .learned import init_routing_state as init_routing_state
from .learned import init_sinkhorn_sort_net as init_sinkhorn_sort_net
from .learned import lsh_attention as lsh_attention
from .learned import routing_attention as routing_attention
from .learned import RoutingAux as RoutingAux
from .learned import RoutingState as RoutingState
from .learned import sinkhorn_attention as sinkhorn_attention
from .learned import SinkhornSortNet as SinkhornSortNet
from .learned import sparsemax as sparsemax
from .learned import topk_attention as topk_attention
from .priors import AverageGate as AverageGate
from .priors import AverageState as AverageState
from .priors import average_attention as average_attention
from .priors import average_attention_init_state as average_attention_init_state
from .priors import average_attention_step as average_attention_step
from .priors import init_average_gate as init_average_gate
from .priors import collaborative_attention as collaborative_attention
from .priors import collaborative_mixing_from_heads as collaborative_mixing_from_heads
from .priors import attention_weights as attention_weights
from .priors import init_predictive_conv as init_predictive_conv
from .priors import lazy_attention as lazy_attention
from .priors import predictive_attention as predictive_attention
from .priors import predictive_conv as predictive_conv
from .priors import realformer_attention as realformer_attention
from .priors import realformer_flash_attention as realformer_flash_attention
from .priors import Disagreement as Disagreement
from .priors import disagreement as disagreement
from .priors import distance_prior_attention as distance_prior_attention
from .priors import gaussian_prior_attention as gaussian_prior_attention
from .priors import hardcoded_gaussian_attention as hardcoded_gaussian_attention
from .priors import init_gaussian_window as init_gaussian_window
from .priors import predict_gaussian_window as predict_gaussian_window
from .priors import multiscale_attention as multiscale_attention
from .priors import multiscale_patterns as multiscale_patterns
from .priors import talking_heads_attention as talking_heads_attention
from .priors import init_routing_votes as init_routing_votes
from .priors import routing_aggregation as routing_aggregation
from .priors import squash as squash
from .modern import deepseek_sparse_attention as deepseek_sparse_attention
from .modern import deepseek_sparse_tiled as deepseek_sparse_tiled
from .modern import differential_attention as differential_attention
from .modern import differential_lambda as differential_lambda
from .modern import forgetting_attention as forgetting_attention
from .modern import indexer_alignment_loss as indexer_alignment_loss
from .modern import lambda_init_for as lambda_init_for
from .modern import lightning_indexer as lightning_indexer
from .modern import mha_cache_bytes_per_token as mha_cache_bytes_per_token
from .modern import mla_cache_bytes_per_token as mla_cache_bytes_per_token
from .modern import multi_head_latent_attention as multi_head_latent_attention
from .modern import moba_attention as moba_attention
from .modern import native_sparse_attention as native_sparse_attention
from .modern import path_attention as path_attention
from .modern import path_update_keys as path_update_keys

from ._kinds import KINDS as _EXACT_KINDS
from .learned._kinds import KINDS as _LEARNED_KINDS
from .linear._kinds import KINDS as _LINEAR_KINDS
from .lowrank._kinds import KINDS as _LOWRANK_KINDS
from .priors._kinds import KINDS as _PRIORS_KINDS
from .modern._kinds import KINDS as _MODERN_KINDS
from .sparse._kinds import KINDS as _SPARSE_KINDS

# Every attention kind, in family order (xformers_jax.kinds.FAMILIES["attention"]).
KINDS = (*_EXACT_KINDS, *_SPARSE_KINDS, *_LINEAR_KINDS, *_LOWRANK_KINDS, *_LEARNED_KINDS,
         *_PRIORS_KINDS, *_MODERN_KINDS)
