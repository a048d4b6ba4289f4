"""Learned and content-based sparsity: LSH (Reformer), routing, Cluster-Former's clusters,
Sinkhorn, entmax, top-k, adaptive span, DAM.

Every public name here is also exported by ``xformers_jax.attention``.
"""

from ._adaptive_span import adaptive_span_attention as adaptive_span_attention
from ._adaptive_span import adaptive_span_penalty as adaptive_span_penalty
from ._clusterformer import assign_clusters as assign_clusters
from ._clusterformer import cluster_chunk_attention as cluster_chunk_attention
from ._clusterformer import kmeans_centroids as kmeans_centroids
from ._dam import dam_attention as dam_attention
from ._dam import dam_mask as dam_mask
from ._dam import dam_penalty as dam_penalty
from ._dam import init_dam_logits as init_dam_logits
from ._entmax import entmax15 as entmax15
from ._entmax import entmax_alpha as entmax_alpha
from ._entmax import entmax_attention as entmax_attention
from ._entmax import entmax_bisect as entmax_bisect
from ._entmax import sparsemax as sparsemax
from ._lsh import init_lsh_rotations as init_lsh_rotations
from ._lsh import lsh_attention as lsh_attention
from ._routing import RoutingAux as RoutingAux
from ._routing import RoutingState as RoutingState
from ._routing import init_routing_state as init_routing_state
from ._routing import routing_attention as routing_attention
from ._sinkhorn import SinkhornSortNet as SinkhornSortNet
from ._sinkhorn import init_sinkhorn_sort_net as init_sinkhorn_sort_net
from ._sinkhorn import sinkhorn_attention as sinkhorn_attention
from ._topk import topk_attention as topk_attention
