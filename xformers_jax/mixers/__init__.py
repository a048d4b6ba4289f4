"""Token mixers that are not attention: gated linear recurrences on the one chunked causal
scan (RetNet, GLA, HGRN2, Mamba-2's SSD and its log-linear form, xLSTM's mLSTM, Gated
DeltaNet, Kimi Delta Attention, RWKV-7, DeltaProduct), diagonal state space models (S4D, S5,
Mamba's selective scan), the long convolutions trained by FFT (H3, Hyena), the MLP / Fourier /
pooling / lambda mixers (one-sequence functions) and LSRA's lightweight convolution.
:data:`KINDS` holds every mixer as a :class:`xformers_jax.kinds.Kind` record; the Equinox
modules and the one slot registry are in
:mod:`xformers_jax.nn` (``MixerSpec``).
"""

from ._conv import causal_depthwise_conv as causal_depthwise_conv
from ._conv import causal_depthwise_step as causal_depthwise_step
from ._conv import lightweight_conv as lightweight_conv
from ._kinds import KINDS as KINDS

from ._mixing import fourier_mixing as fourier_mixing
from ._mixing import lambda_mixing as lambda_mixing
from ._mixing import pool_mixing as pool_mixing
from ._mixing import spatial_gating as spatial_gating
from ._mixing import token_mixing_mlp as token_mixing_mlp
from ._delta_rules import DELTA_PRODUCT_CHUNK as DELTA_PRODUCT_CHUNK
from ._delta_rules import DPLR_CHUNK as DPLR_CHUNK
from ._delta_rules import delta_product as delta_product
from ._delta_rules import delta_product_step as delta_product_step
from ._delta_rules import kda as kda
from ._delta_rules import kda_step as kda_step
from ._delta_rules import rwkv7 as rwkv7
from ._delta_rules import rwkv7_step as rwkv7_step
from ._longconv import h3 as h3
from ._longconv import h3_init_state as h3_init_state
from ._longconv import h3_step as h3_step
from ._longconv import hyena as hyena
from ._longconv import hyena_step as hyena_step
from ._loglinear import LOGLINEAR_CHUNK as LOGLINEAR_CHUNK
from ._loglinear import loglinear_linear as loglinear_linear
from ._loglinear import loglinear_ssd as loglinear_ssd
from ._mlstm import mlstm as mlstm
from ._mlstm import mlstm_init_state as mlstm_init_state
from ._mlstm import mlstm_step as mlstm_step
from ._recurrences import GLA_CHUNK as GLA_CHUNK
from ._recurrences import gated_delta as gated_delta
from ._recurrences import gla as gla
from ._recurrences import hgrn2 as hgrn2
from ._recurrences import linear_recurrence as linear_recurrence
from ._recurrences import retention as retention
from ._recurrences import ssd as ssd
from ._ssm import causal_convolve as causal_convolve
from ._ssm import s4d as s4d
from ._ssm import s4d_kernel as s4d_kernel
from ._ssm import s4d_step as s4d_step
from ._ssm import s5 as s5
from ._ssm import s5_step as s5_step
from ._ssm import selective_scan as selective_scan
from ._ssm import selective_step as selective_step
from ._ssm import zoh as zoh
