"""Attention variants as pure functions over one sequence and one head.

The contract (see ``_contract``): ``variant(q [Lq, Dk], k [Lk, Dk], v [Lk, Dv], *arrays,
causal=False, kv_mask=None, scale=None, key=None, **hyperparameters) -> [Lq, Dv]``. Lift any
variant to ``[batch, length, heads, dim]`` with :func:`multihead`.
"""

from . import patterns as patterns
from ._dense import dot_product_attention as dot_product_attention
from ._flash import block_sparse_attention as block_sparse_attention
from ._flash import flash_attention as flash_attention
from ._multihead import multihead as multihead
# --- sparse family (issue 3) ---
# --- kernelized / linear family (issue 4) ---
# --- low-rank / compression family (issue 5) ---
# --- learned sparsity family (issue 6) ---
