"""Sparse models and the block's FFNs as pure functions: routers (top-k, expert choice, hash,
prototypes, BASE layers' balanced assignment), auxiliary losses, capacity and dropless dispatch
(the grouped matmul backend switch), product-key memory lookup, Scaling Transformers' sparse
QKV and sparse FFN, and the dense FFN. The Equinox layers over them are in ``xformers_jax.nn``
(``FeedForward``, ``MoEFeedForward``, ``ProductKeyMemory``, ``SparseQKVAttention``, ...);
expert parallelism is in ``xformers_jax.parallel``. :data:`KINDS` holds every FFN kind as a
:class:`xformers_jax.kinds.Kind` record.
"""

from ._balanced import balanced_assignment as balanced_assignment
from ._balanced import base_route as base_route
from ._dispatch import ACTIVATIONS as ACTIVATIONS
from ._dispatch import CAPACITY_GROUPS as CAPACITY_GROUPS
from ._dispatch import MODES as DISPATCH_MODES
from ._dispatch import CapacityState as CapacityState
from ._dispatch import ExpertWeights as ExpertWeights
from ._dispatch import capacity as capacity
from ._dispatch import capacity_slots as capacity_slots
from ._dispatch import expert_choice_ffn as expert_choice_ffn
from ._dispatch import init_expert_weights as init_expert_weights
from ._dispatch import moe_capacity as moe_capacity
from ._dispatch import moe_dropless as moe_dropless
from ._dispatch import moe_ffn as moe_ffn
from ._dispatch import moe_reference as moe_reference
from ._dispatch import sequence_capacity_slots as sequence_capacity_slots
from ._ffn import FFN_ACTIVATIONS as FFN_ACTIVATIONS
from ._ffn import GATED as GATED
from ._ffn import feed_forward as feed_forward
from ._ffn import no_feed_forward as no_feed_forward
from ._ffn import sparse_controller as sparse_controller
from ._ffn import sparse_feed_forward as sparse_feed_forward
from ._ffn import sparse_masked as sparse_masked
from ._grouped import default_backend as default_backend
from ._grouped import grouped_matmul as grouped_matmul
from ._grouped import grouped_matmul_backends as grouped_matmul_backends
from ._grouped import register_grouped_matmul as register_grouped_matmul
from ._kinds import KINDS as KINDS
from ._losses import LOAD_BALANCING_COEF as LOAD_BALANCING_COEF
from ._losses import Z_LOSS_COEF as Z_LOSS_COEF
from ._losses import expert_load as expert_load
from ._losses import load_balancing_loss as load_balancing_loss
from ._losses import router_z_loss as router_z_loss
from ._product_keys import product_key_lookup as product_key_lookup
from ._sparse_qkv import module_conv as module_conv
from ._sparse_qkv import multiplicative_dense as multiplicative_dense
from ._sparse_qkv import sparse_qkv as sparse_qkv
from ._product_keys import product_key_topk as product_key_topk
from ._routers import ExpertChoice as ExpertChoice
from ._routers import Routing as Routing
from ._routers import balanced_hash_table as balanced_hash_table
from ._routers import expert_choice_capacity as expert_choice_capacity
from ._routers import expert_choice_route as expert_choice_route
from ._routers import hash_route as hash_route
from ._routers import prototype_route as prototype_route
from ._routers import router_logits as router_logits
from ._routers import top_k_route as top_k_route
from ._parallel import expert_parallel_moe as expert_parallel_moe
from ._parallel import grouped_moe as grouped_moe
