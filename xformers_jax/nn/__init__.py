"""Building blocks and slot implementations: attention over any registered kind, token mixers,
FFN and mixture-of-experts layers, block memories, positions, norms, blocks, layer stacks and
decoding caches (see ``xformers_jax.attention`` for the attention functions themselves and
``xformers_jax.models`` for whole models).

A block's slots are filled by name from the one slot registry (:mod:`._slots`): its attention
with :class:`AttentionSpec`, a token mixer replacing it with :class:`MixerSpec`, its FFN with
:class:`FFNSpec` (``kind`` plus hyperparameters; every model accepts them through
``block=dict(spec=..., mixer=..., ffn=...)``). Every kind is a :class:`xformers_jax.kinds.Kind`
record (:func:`get_kind`, :func:`registered_kinds`, :func:`register_kind`).
"""

from ._mixer import LSRA as LSRA
from ._attention import MultiHeadAttention as MultiHeadAttention
from ._attention_layers import AllAttention as AllAttention
from ._attention_layers import SparseQKVAttention as SparseQKVAttention
from ._attention import check_sequence_parallel as check_sequence_parallel
from ._attention import redraw_random_features as redraw_random_features
from ._blocks import TransformerBlock as TransformerBlock
from ._blocks import check_segments as check_segments
from ._cache import BlockCache as BlockCache
from ._cache import KVCache as KVCache
from ._cache import PagedKVCache as PagedKVCache
from ._cache import RecurrentCache as RecurrentCache
from ._carry import Carry as Carry
from ._ffn import FeedForward as FeedForward
from ._ffns import AUX_WEIGHTS as AUX_WEIGHTS
from ._ffns import aux_losses as aux_losses
from ._ffns import aux_terms as aux_terms
from ._ffns import decode_ffn as decode_ffn
from ._ffns import init_ffn_cache as init_ffn_cache
from ._moe import MoEFeedForward as MoEFeedForward
from ._moe import NoFeedForward as NoFeedForward
from ._moe import ProductKeyMemory as ProductKeyMemory
from ._moe import SparseFeedForward as SparseFeedForward
from ._cycle import BlockCycle as BlockCycle
from ._cycle import transformer_stack as transformer_stack
from ._embed import CLS_TOKEN_ID as CLS_TOKEN_ID
from ._embed import Embedder as Embedder
from ._memory import COMPRESSIONS as COMPRESSIONS
from ._memory import CompressiveMemory as CompressiveMemory
from ._memory import Memory as Memory
from ._memory import MEMORY_ATTENTION_KINDS as MEMORY_ATTENTION_KINDS
from ._memory import MemoryState as MemoryState
from ._memory import XLMemory as XLMemory
from ._memory import compress as compress
from ._memory import memory_attention as memory_attention
from ._memory import memory_aux_loss as memory_aux_loss
from ._memory import reconstruction_loss as reconstruction_loss
from ._memory import reset_memory as reset_memory
from ._memory import with_eval_memory as with_eval_memory
from ._norms import AdaNorm as AdaNorm
from ._norms import LayerNorm as LayerNorm
from ._norms import Norm as Norm
from ._norms import PowerNorm as PowerNorm
from ._norms import RMSNorm as RMSNorm
from ._norms import ScaledL2Norm as ScaledL2Norm
from ._norms import StatefulNorm as StatefulNorm
from ._norms import make_norm as make_norm
from ._positions import TUPE as TUPE
from ._positions import ALiBi as ALiBi
from ._positions import BiasScheme as BiasScheme
from ._positions import ConvPositions as ConvPositions
from ._positions import DeBERTaRelative as DeBERTaRelative
from ._positions import InputScheme as InputScheme
from ._positions import LearnedPositions as LearnedPositions
from ._positions import LearnedSinusoidalPositions as LearnedSinusoidalPositions
from ._positions import NoPositions as NoPositions
from ._positions import PositionScheme as PositionScheme
from ._positions import QKScheme as QKScheme
from ._positions import RotaryPositions as RotaryPositions
from ._positions import ShawRelative as ShawRelative
from ._positions import SinusoidalPositions as SinusoidalPositions
from ._positions import T5Bias as T5Bias
from ._positions import TransformerXLRelative as TransformerXLRelative
from ._positions import document_positions as document_positions
from ._positions import sinusoid as sinusoid
from ._positions import t5_bucket as t5_bucket
from ._precision import Policy as Policy
from ._attention import routing_commitment_loss as routing_commitment_loss
from ._mixer import MixerModule as MixerModule
from ._mixer import SSM_PARAMETERS as SSM_PARAMETERS
from ._mixer import ssm_parameters as ssm_parameters
from ._slots import AttentionSpec as AttentionSpec
from ._slots import FFNSpec as FFNSpec
from ._slots import MixerSpec as MixerSpec
from ._slots import Spec as Spec
from ._slots import get_kind as get_kind
from ._slots import implements as implements
from ._slots import register_kind as register_kind
from ._slots import registered_kinds as registered_kinds
from ._sampling import pick_token as pick_token
from ._sampling import sample_tokens as sample_tokens
from ._pipeline import bubble_fraction as bubble_fraction
from ._pipeline import gpipe as gpipe
from ._pipeline import microbatches_for as microbatches_for
from ._pipeline import pipeline_layers as pipeline_layers
from ._stack import LayerStack as LayerStack
from ._init import admin_initialize as admin_initialize
from ._init import t_fixup as t_fixup
