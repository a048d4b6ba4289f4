"""Byte-level language modelling with a token mixer instead of attention (the causal
recurrences: S4D, S5, Mamba, Mamba-2, RetNet, GLA, Gated DeltaNet; or causal gMLP / aMLP).

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lm/mixer_bytes.py:MIXER[,runlocal] \
      --workdir=/tmp/lm_mixer

The same task, model sizes and schedule as ``stdlib_bytes.py`` (6 layers, dim 512, 1024-byte
windows; ``runlocal``: dim 64, 2 layers, 128-byte windows, 200 steps), with ``model.mixer``
from ``xformers_jax_experiments/configs/lra/_common.MIXERS`` (S4D / S5 also take their SSM
learning rate).
"""

from xformers_jax import nn
from xformers_jax_experiments.configs.lm import stdlib_bytes
from xformers_jax_experiments.configs.lra import _common

CAUSAL_MIXERS = tuple(m for m in _common.MIXERS if nn.get_kind("mixer", m).causal)


def get_config(arg=None):
    variant, size = _common.parse(arg, default="mamba2")
    if variant not in CAUSAL_MIXERS:
        raise ValueError(f"the LM needs a causal mixer, one of {CAUSAL_MIXERS}; got {variant!r}")
    c = stdlib_bytes.get_config("transformer" + ("," + size if size else ""))
    c.unlock()
    _common.set_attention(c, variant, small=size is not None)
    c.lock()
    return c
