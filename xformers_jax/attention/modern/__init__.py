"""Softmax attention as changed since the surveys: differential attention, forgetting attention
(FoX's forget gates as a score function; FoX Pro's token shift, QK-norm, output norm and
gate around it in the ``fox_pro`` kind), multi-head latent attention, MoBA, native sparse
attention, DeepSeek sparse attention (its lightning indexer), PaTH attention.

Every public name here is also exported by ``xformers_jax.attention``.
"""

from ._differential import differential_attention as differential_attention
from ._differential import differential_lambda as differential_lambda
from ._differential import lambda_init_for as lambda_init_for
from ._dsa import deepseek_sparse_attention as deepseek_sparse_attention
from ._dsa import deepseek_sparse_tiled as deepseek_sparse_tiled
from ._dsa import indexer_alignment_loss as indexer_alignment_loss
from ._dsa import lightning_indexer as lightning_indexer
from ._fox import forgetting_attention as forgetting_attention
from ._mla import mha_cache_bytes_per_token as mha_cache_bytes_per_token
from ._mla import mla_cache_bytes_per_token as mla_cache_bytes_per_token
from ._mla import multi_head_latent_attention as multi_head_latent_attention
from ._moba import moba_attention as moba_attention
from ._nsa import native_sparse_attention as native_sparse_attention
from ._path import path_attention as path_attention
from ._path import path_update_keys as path_update_keys
