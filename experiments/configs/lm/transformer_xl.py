"""Transformer-XL (Dai et al., 2019) on byte-level streams of the standard library's source.

  python -m experiments.train --config=experiments/configs/lm/transformer_xl.py:VARIANT[,runlocal|,cpu] \
      --workdir=/tmp/xl

VARIANT: ``xl`` (memory 256, evaluation memory 1024; evaluation also reports bits per byte
with memory 0, 256, 512 and 2048: ``bits_per_byte_mem0``, ...) or ``none`` (the
same model and relative positions without memory: the baseline of the paper's comparison).
Other evaluation memory lengths: ``--config.data.eval_mem_lens="(0, 512)"``. Sizes in
``_memory.py``.
"""

from experiments.configs.lm import _memory

VARIANTS = {"xl": dict(kind="xl", mem_len=256, eval_mem_len=1024), "none": dict(kind="none")}


def get_config(arg=None):
    variant, size = _memory.parse(arg)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    lens = (0, 256, 512, 2048) if variant == "xl" else ()
    return _memory.config(dict(VARIANTS[variant]), size, eval_mem_lens=lens)
