"""Attention variants as pure functions over one sequence and one head.

The contract (see ``_contract``): ``variant(q [Lq, Dk], k [Lk, Dk], v [Lk, Dv], *arrays,
causal=False, kv_mask=None, scale=None, key=None, **hyperparameters) -> [Lq, Dv]``. Lift any
variant to ``[batch, length, heads, dim]`` with :func:`multihead`.
"""

from . import patterns as patterns
from ._dense import dot_product_attention as dot_product_attention
from ._flash import block_sparse_attention as block_sparse_attention
from ._flash import flash_attention as flash_attention
from ._flash import pattern_tile as pattern_tile
from ._multihead import multihead as multihead
# --- sparse family (issue 3) ---
from ._axial import axial_attention as axial_attention
from ._axial import axial_shift as axial_shift
from ._global_tokens import etc_attention as etc_attention
from ._global_tokens import longformer_attention as longformer_attention
from ._per_head import per_head_block_sparse_attention as per_head_block_sparse_attention
# --- kernelized / linear family (issue 4) ---
from ._delta import delta_rule_attention as delta_rule_attention
from ._delta import delta_rule_init_state as delta_rule_init_state
from ._delta import delta_rule_step as delta_rule_step
from ._feature_maps import dpfp_features as dpfp_features
from ._feature_maps import elu_features as elu_features
from ._feature_maps import favor_positive_features as favor_positive_features
from ._feature_maps import favor_trig_features as favor_trig_features
from ._feature_maps import hyperbolic_features as hyperbolic_features
from ._feature_maps import init_random_projection as init_random_projection
from ._feature_maps import init_rfa_projection as init_rfa_projection
from ._feature_maps import relu_features as relu_features
from ._feature_maps import rfa_features as rfa_features
from ._linear import LinearAttentionState as LinearAttentionState
from ._linear import linear_attention as linear_attention
from ._linear import linear_attention_init_state as linear_attention_init_state
from ._linear import linear_attention_step as linear_attention_step
from ._linear import performer_attention as performer_attention
# --- low-rank / compression family (issue 5) ---
from ._lowrank_band import init_lowrank_band as init_lowrank_band
from ._lowrank_band import lowrank_band_attention as lowrank_band_attention
from ._clustered import clustered_attention as clustered_attention
from ._clustered import improved_clustered_attention as improved_clustered_attention
from ._linformer import init_linformer_projections as init_linformer_projections
from ._linformer import linformer_attention as linformer_attention
from ._long_short import init_long_short_projection as init_long_short_projection
from ._long_short import long_short_attention as long_short_attention
from ._luna import init_luna_sequence as init_luna_sequence
from ._luna import luna_attention as luna_attention
from ._memory_compressed import init_memory_compression as init_memory_compression
from ._memory_compressed import memory_compressed_attention as memory_compressed_attention
from ._nystrom import init_nystrom_conv as init_nystrom_conv
from ._nystrom import nystrom_attention as nystrom_attention
from ._poolingformer import poolingformer_attention as poolingformer_attention
from ._probsparse import probsparse_attention as probsparse_attention
from ._synthesizer import init_synthesizer as init_synthesizer
from ._synthesizer import synthesizer_attention as synthesizer_attention
from ._token_pooling import funnel_attention as funnel_attention
from ._token_pooling import funnel_pool as funnel_pool
from ._token_pooling import funnel_upsample as funnel_upsample
from ._token_pooling import init_token_learner as init_token_learner
from ._token_pooling import token_learner as token_learner
# --- learned sparsity family (issue 6) ---
from ._lsh import init_lsh_rotations as init_lsh_rotations
from ._lsh import lsh_attention as lsh_attention
from ._routing import RoutingAux as RoutingAux
from ._routing import RoutingState as RoutingState
from ._routing import init_routing_state as init_routing_state
from ._routing import routing_attention as routing_attention
from ._sinkhorn import SinkhornSortNet as SinkhornSortNet
from ._sinkhorn import init_sinkhorn_sort_net as init_sinkhorn_sort_net
from ._sinkhorn import sinkhorn_attention as sinkhorn_attention
from ._entmax import entmax15 as entmax15
from ._entmax import entmax_alpha as entmax_alpha
from ._entmax import entmax_attention as entmax_attention
from ._entmax import entmax_bisect as entmax_bisect
from ._entmax import sparsemax as sparsemax
from ._topk import topk_attention as topk_attention
from ._adaptive_span import adaptive_span_attention as adaptive_span_attention
from ._adaptive_span import adaptive_span_penalty as adaptive_span_penalty
from ._dam import dam_attention as dam_attention
from ._dam import dam_mask as dam_mask
from ._dam import dam_penalty as dam_penalty
from ._dam import init_dam_logits as init_dam_logits
