"""Token mixers as a block slot: every mixer's module (each declares the kinds it implements
with ``nn.implements``; their records are ``xformers_jax.mixers.KINDS``) and what they share
(:mod:`._base`). A block names its mixer with ``nn.MixerSpec`` (:mod:`.._slots`)."""

from .._slots import MixerSpec, make_mixer
from ._base import SSM_PARAMETERS, MixerModule, ssm_parameters
from ._lite import LSRA
from ._longconv import H3, Hyena
from ._loglinear import LogLinearLinear, LogLinearMamba2
from ._mlp import FNet, GMLP, Lambda, MLPMixer, PoolFormer
from ._recurrent import GLA, GatedDeltaNet, Mamba, Mamba2, RetNet
from ._recurrent_recent import HGRN2, MLSTM, RWKV7, GatedDeltaProduct, KimiDeltaAttention
from ._ssm import S4D, S5

__all__ = ["FNet", "GLA", "GMLP", "GatedDeltaNet", "GatedDeltaProduct", "H3", "HGRN2", "Hyena",
           "KimiDeltaAttention", "LSRA", "Lambda", "LogLinearLinear", "LogLinearMamba2",
           "MLPMixer", "MLSTM", "Mamba", "Mamba2",
           "MixerModule", "MixerSpec", "PoolFormer", "RWKV7", "RetNet", "S4D", "S5",
           "SSM_PARAMETERS", "make_mixer", "ssm_parameters"]
