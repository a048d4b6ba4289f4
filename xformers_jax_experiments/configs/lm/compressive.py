"""The Compressive Transformer (Rae et al., 2020) on byte-level streams of the standard
library's source: memory 256 and compressed memory 256 at rate 4, with the attention-
reconstruction loss training the compression. Evaluation also reports bits per byte with
memory 0 and 1024 (the compressed memory kept at 256).

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lm/compressive.py:COMPRESSION[,runlocal] \
      --workdir=/tmp/compressive

COMPRESSION: ``conv`` (the paper's best), ``dilated_conv``, ``max``, ``mean``, ``most_used``.
Sizes in ``_memory.py``.
"""

from xformers_jax import nn
from xformers_jax_experiments.configs.lm import _memory


def get_config(arg=None):
    compression, size = _memory.parse(arg or "conv")
    if compression not in nn.COMPRESSIONS:
        raise ValueError(f"compression must be one of {nn.COMPRESSIONS}, got {compression!r}")
    return _memory.config(dict(kind="compressive", mem_len=256, cmem_len=256, rate=4,
                               compression=compression), size, eval_mem_lens=(0, 1024))
