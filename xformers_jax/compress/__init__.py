"""Lighter models: quantization (int8 PTQ with calibrated activations, QAT with fake
quantization, weight-only int4), pruning (magnitude, gradual schedule, lottery tickets, heads,
layers) and knowledge distillation losses, for any model of ``xformers_jax.nn``.
"""

from ._quant import FakeQuantWeight as FakeQuantWeight
from ._quant import Int4Weight as Int4Weight
from ._quant import MATMUL_WEIGHTS as MATMUL_WEIGHTS
from ._quant import QuantizedWeight as QuantizedWeight
from ._quant import absmax_scale as absmax_scale
from ._quant import calibrate as calibrate
from ._quant import dequantize as dequantize
from ._quant import dequantize_model as dequantize_model
from ._quant import fake_quant as fake_quant
from ._quant import int8_matmul as int8_matmul
from ._quant import model_bytes as model_bytes
from ._quant import quantize as quantize
from ._quant import quantize_model as quantize_model
from ._prune import PruneState as PruneState
from ._prune import apply_masks as apply_masks
from ._prune import drop_layers as drop_layers
from ._prune import gradual_sparsity as gradual_sparsity
from ._prune import head_importance as head_importance
from ._prune import head_masks as head_masks
from ._prune import lottery_ticket as lottery_ticket
from ._prune import magnitude_masks as magnitude_masks
from ._prune import masks_of as masks_of
from ._prune import ones_masks as ones_masks
from ._prune import prune_transform as prune_transform
from ._prune import rewind as rewind
from ._prune import sparsity_report as sparsity_report
from ._prune import with_layerdrop as with_layerdrop
from ._distill import TinyBertProjections as TinyBertProjections
from ._distill import attention_map_loss as attention_map_loss
from ._distill import cosine_hidden_loss as cosine_hidden_loss
from ._distill import distilbert_init as distilbert_init
from ._distill import hidden_mse_loss as hidden_mse_loss
from ._distill import hidden_states as hidden_states
from ._distill import kd_loss as kd_loss
from ._distill import layer_map as layer_map
from ._distill import tinybert_loss as tinybert_loss
