"""Transformer-XL (Dai et al., 2019) on byte-level streams of the standard library's source.

  python -m experiments.train --config=experiments/configs/lm/transformer_xl.py:VARIANT[,runlocal|,cpu] \
      --workdir=/tmp/xl

VARIANT: ``xl`` (memory 256, evaluation memory 1024; evaluation also reports bits per byte
with memory 0, 256, 512 and 2048: ``bits_per_byte_mem0``, ...) or ``none`` (the
same model and relative positions without memory: the baseline of the paper's comparison).
Other evaluation memory lengths: ``--config.data.eval_mem_lens="(0, 512)"``. Sizes in
``_memory.py``.

Measured with ``xl,cpu`` and ``none,cpu`` (segment 32, training memory 32, evaluation memory
128; dim 128, 2 layers, 1500 steps on 16 streams; shared 2-core CPU at load 7-14), bits per
byte, validation / test: no memory 2.539 / 2.531; XL with evaluation memory 0: 2.931 / 3.013,
32 (the training length): 2.501 / 2.478, 64: 2.494 / 2.467, 128: 2.516 / 2.491, 256: 2.561 /
2.546. At step 500 the memoryless model was ahead (2.809 against XL's 2.888 at memory 32); XL
passed it by step 1000 (2.618 against 2.641). Memory helps once trained to be read; an
evaluation memory of twice the training one helps a little more, longer ones hurt (relative
distances never seen in training).

At the issue's lengths (``xl,cpu256`` and ``none,cpu256``: segment 256, training memory 256,
3000 steps; ``experiments/results/memory_lm.md``) the two end level on validation (1.974 with
memory 256 against 1.973 without), XL slightly ahead on test (2.085 against 2.100), and longer
evaluation memories do not help (1024: 1.987; 2048: 2.022). The memoryless model led by 0.06
bits per byte at step 1000 and 0.02 at 2000: memory is learned slowly at this size.
"""

from experiments.configs.lm import _memory

VARIANTS = {"xl": dict(kind="xl", mem_len=256, eval_mem_len=1024), "none": dict(kind="none")}


def get_config(arg=None):
    variant, size = _memory.parse(arg)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    lens = (0, 256, 512, 2048) if variant == "xl" else ()
    return _memory.config(dict(VARIANTS[variant]), size, eval_mem_lens=lens)
