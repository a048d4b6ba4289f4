"""Structured sparse attention built on the tiled kernel: axial, global tokens (ETC, Longformer),
per-head patterns.

Every public name here is also exported by ``xformers_jax.attention``.
"""

from ._axial import axial_attention as axial_attention
from ._axial import axial_shift as axial_shift
from ._global_tokens import etc_attention as etc_attention
from ._global_tokens import longformer_attention as longformer_attention
from ._per_head import per_head_block_sparse_attention as per_head_block_sparse_attention
