"""Token mixers as a block slot: the registry (:mod:`._registry`) and every mixer's module,
registered from the metadata in :mod:`xformers_jax.mixers._kinds`."""

from ...mixers._kinds import KINDS
from ._mlp import FNet, GMLP, Lambda, MLPMixer, PoolFormer
from ._recurrent import GLA, GatedDeltaNet, Mamba, Mamba2, RetNet
from ._registry import (SSM_PARAMETERS, MixerModule, MixerSpec, MixerVariant, get_mixer,
                        make_mixer, register_mixer, registered_mixers, ssm_parameters)
from ._ssm import S4D, S5

_SSM_HP = {"state_size", "dt_min", "dt_max", "implementation"}
_BUILDERS = {
    "retnet": (RetNet, {"chunk_size", "implementation"}),
    "gla": (GLA, {"chunk_size", "implementation"}),
    "mamba2": (Mamba2, {"state_size", "expand", "conv_width", "dt_min", "dt_max", "chunk_size",
                        "implementation"}),
    "mamba": (Mamba, {"state_size", "expand", "conv_width", "dt_min", "dt_max",
                      "implementation"}),
    "gated_deltanet": (GatedDeltaNet, {"chunk_size", "implementation", "dt_min", "dt_max"}),
    "s4d": (S4D, _SSM_HP),
    "s5": (S5, _SSM_HP),
    "mlp_mixer": (MLPMixer, {"token_hidden"}),
    "gmlp": (GMLP, {"expansion"}),
    "amlp": (lambda *a, attention_dim=64, **kw: GMLP(*a, attention_dim=attention_dim, **kw),
             {"expansion", "attention_dim"}),
    "fnet": (FNet, set()),
    "poolformer": (PoolFormer, {"pool_size"}),
    "lambda": (Lambda, {"key_dim", "window"}),
}

for _kind in KINDS:
    _build, _hp = _BUILDERS[_kind.name]
    register_mixer(MixerVariant(_kind.name, _build, _kind, frozenset(_hp)))

__all__ = ["FNet", "GLA", "GMLP", "GatedDeltaNet", "Lambda", "MLPMixer", "Mamba", "Mamba2",
           "MixerModule", "MixerSpec", "MixerVariant", "PoolFormer", "RetNet", "S4D", "S5",
           "SSM_PARAMETERS", "get_mixer", "make_mixer", "register_mixer", "registered_mixers",
           "ssm_parameters"]
