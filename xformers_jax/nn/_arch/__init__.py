"""Architecture-level variants: models whose change is in how blocks, tokens and layers are
arranged rather than in one attention kind (Swin's shifted windows and patch merging, Lite
Transformer's long-short range attention, DeLighT's expand-reduce blocks and block-wise
scaling, transparent attention over all encoder layers, Charformer's GBST, Cluster-Former,
hierarchical HIBERT and TNT)."""

from ._clusterformer import ClusterformerAttention as ClusterformerAttention
from ._clusterformer import cluster_chunk_attention as cluster_chunk_attention
from ._clusterformer import kmeans_centroids as kmeans_centroids
from ._delight import DeLighTBlock as DeLighTBlock
from ._delight import DeLighTStack as DeLighTStack
from ._delight import DeLighTTransform as DeLighTTransform
from ._delight import GroupLinear as GroupLinear
from ._delight import delight_scaling as delight_scaling
from ._gbst import GBST as GBST
from ._hierarchical import HierarchicalEncoder as HierarchicalEncoder
from ._hierarchical import TNTClassifier as TNTClassifier
from ._hierarchical import TNTLayer as TNTLayer
from ._lite import LSRA as LSRA
from ._swin import PatchMerging as PatchMerging
from ._swin import SwinBlock as SwinBlock
from ._swin import SwinClassifier as SwinClassifier
from ._swin import WindowAttention as WindowAttention
from ._swin import window_groups as window_groups
from ._transparent import TransparentEncoderDecoder as TransparentEncoderDecoder
