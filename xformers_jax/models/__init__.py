"""Whole models, one family per module, and the model registry a config names them from.

A model is built from ``nn``'s blocks, stacks and slots; every one a trainer can train is
registered (:func:`register_model`, ``model.kind`` in a config; :func:`registered_models`),
takes ``return_aux=True`` and then returns ``(outputs, aux)``, its auxiliary outputs, which
its :class:`ModelKind` turns into named loss terms with default weights.

Families: the encoder trunk and classifiers (:class:`EncoderClassifier`, :class:`DualEncoder`),
the language model (:class:`CausalLM`) with memory LMs over streams (``memory_lm``),
:class:`FeedbackLM`, :class:`Memformer`, the encoder-decoder, ELECTRA, Perceiver, the Set
Transformer's blocks, adaptive depth (ACT, early exit), Swin, hierarchical encoders (HIBERT,
TNT), transparent attention, DeLighT, Charformer's GBST and Cluster-Former.
"""

from ._registry import SLOTS as SLOTS
from ._registry import TASK_TERM as TASK_TERM
from ._registry import TASK_TYPES as TASK_TYPES
from ._registry import TRUNK as TRUNK
from ._registry import ModelKind as ModelKind
from ._registry import block_kwargs as block_kwargs
from ._registry import get_model as get_model
from ._registry import model_defaults as model_defaults
from ._registry import register_model as register_model
from ._registry import registered_models as registered_models
from ._trunk import Encoder as Encoder
from ._trunk import pool as pool
from ._classifiers import DualEncoder as DualEncoder
from ._classifiers import EncoderClassifier as EncoderClassifier
from ._lm import CausalLM as CausalLM
from ._serving import PagePool as PagePool
from ._serving import Prefix as Prefix
from ._serving import Request as Request
from ._serving import ServeStats as ServeStats
from ._serving import Server as Server
from ._serving import cache_bytes as cache_bytes
from ._serving import decode_compiler_options as decode_compiler_options
from ._serving import init_rows as init_rows
from ._serving import prefill_rows as prefill_rows
from ._serving import sequence_cache_bytes as sequence_cache_bytes
from ._serving import step_rows as step_rows
from ._memory_lm import MemoryModel as MemoryModel
from ._memory_lm import SegmentCache as SegmentCache
from ._memory_lm import generate_with_memory as generate_with_memory
from ._memory_lm import has_memory as has_memory
from ._memory_lm import retrospective_feed as retrospective_feed
from ._feedback import FeedbackLM as FeedbackLM
from ._feedback import FeedbackState as FeedbackState
from ._memformer import Memformer as Memformer
from ._memformer import memory_replay_gradients as memory_replay_gradients
from ._seq2seq import EncoderDecoder as EncoderDecoder
from ._electra import Electra as Electra
from ._perceiver import PerceiverAR as PerceiverAR
from ._perceiver import PerceiverEncoder as PerceiverEncoder
from ._set import ISAB as ISAB
from ._set import MAB as MAB
from ._set import PMA as PMA
from ._set import SAB as SAB
from ._adaptive import ACTClassifier as ACTClassifier
from ._adaptive import ACTInfo as ACTInfo
from ._adaptive import ACTStack as ACTStack
from ._adaptive import EarlyExitClassifier as EarlyExitClassifier
from ._adaptive import ExitResult as ExitResult
from ._adaptive import ExitsClassifier as ExitsClassifier
from ._adaptive import early_exit_loss as early_exit_loss
from ._adaptive import evaluate_exits as evaluate_exits
from ._swin import PatchMerging as PatchMerging
from ._swin import PixelSwin as PixelSwin
from ._swin import SwinBlock as SwinBlock
from ._swin import SwinClassifier as SwinClassifier
from ._swin import WindowAttention as WindowAttention
from ._swin import window_groups as window_groups
from ._hierarchical import HierarchicalEncoder as HierarchicalEncoder
from ._hierarchical import TNTClassifier as TNTClassifier
from ._hierarchical import TNTLayer as TNTLayer
from ._transparent import TransparentEncoderDecoder as TransparentEncoderDecoder
from ._delight import DeLighTBlock as DeLighTBlock
from ._delight import DeLighTStack as DeLighTStack
from ._delight import DeLighTTransform as DeLighTTransform
from ._delight import GroupLinear as GroupLinear
from ._delight import delight_scaling as delight_scaling
from ._gbst import GBST as GBST
from ._clusterformer import ClusterformerAttention as ClusterformerAttention
