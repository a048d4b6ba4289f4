"""Transformer-XL (Dai et al., 2019) on byte-level streams of the standard library's source.

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lm/transformer_xl.py:VARIANT[,runlocal|,cpu] \
      --workdir=/tmp/xl

VARIANT: ``xl`` (memory 256, evaluation memory 1024; evaluation also reports bits per byte
with memory 0, 256, 512 and 2048: ``bits_per_byte_mem0``, ...) or ``none`` (the
same model and relative positions without memory: the baseline of the paper's comparison).
Other evaluation memory lengths: ``--config.data.eval_mem_lens="(0, 512)"``. Sizes in
``_memory.py``.

Measured with ``xl,cpu`` and ``none,cpu`` (segment 32, training memory 32, evaluation memory
128; dim 128, 2 layers, 1500 steps on 16 streams; shared 2-core CPU at load 7-14; before
relative distances were clamped at the training length), bits per byte, validation / test: no
memory 2.539 / 2.531; XL with evaluation memory 0: 2.931 / 3.013, 32 (the training length):
2.501 / 2.478, 64: 2.494 / 2.467, 128: 2.516 / 2.491, 256: 2.561 / 2.546.

At the study's lengths (``xl,cpu256`` and ``none,cpu256``: segment 256, training memory 256,
6000 steps; the study ``xformers_jax_experiments/studies/memory_lm/``, one seed each), validation
bits per byte: no memory 1.823; XL with evaluation memory 256 (the training length) 1.712, 512
1.705, 1024 (the configured evaluation memory) 1.709, 2048 1.724, 0 2.073 (test: 1.995 against
1.878, 1.874, 1.879, 1.896). XL led at every evaluation (steps 2000 and 4000: 2.154 and 1.877
against 2.160 and 1.954). Longer evaluation memories need the distances clamped at the
longest one training saw (511; ``model.memory.clamp_len``): on the 3000-step checkpoint of an
earlier run (a one-off evaluation of it with this trainer's model, clamped and with
``clamp_len=-1``), evaluation memory 1024 scored 1.987 unclamped and 1.972 clamped, against
1.974 at 256. A 3000-step schedule had ended with the two models level (1.974 against
1.973): memory is learned slowly at this size.
"""

from xformers_jax_experiments.configs.lm import _memory

VARIANTS = {"xl": dict(kind="xl", mem_len=256, eval_mem_len=1024), "none": dict(kind="none")}


def get_config(arg=None):
    variant, size = _memory.parse(arg)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    lens = (0, 256, 512, 2048) if variant == "xl" else ()
    return _memory.config(dict(VARIANTS[variant]), size, eval_mem_lens=lens)
