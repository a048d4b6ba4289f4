"""Memformer (Wu et al., 2022) on byte-level streams of the standard library's source: memory
slots read by cross attention and written by slot attention after each piece of a segment.

  python -m xformers_jax_experiments.train \\
      --config=xformers_jax_experiments/configs/lm/memformer.py[:runlocal] \\
      --workdir=/tmp/memformer

Each training segment is read as ``segments`` pieces with gradients through the slots between
them (memory replay back-propagation: one piece's activations alive at a time); the slots passed
to the next step are detached. 32 slots, segment 256 in 4 pieces of 64 (``runlocal``: 16 slots,
segment 64 in 4 pieces of 16); sizes in ``_memory.py``.
"""

from xformers_jax_experiments.configs.lm import _memory


def get_config(arg=None):
    size = "runlocal" if "runlocal" in (arg or "").split(",") else None
    slots = 16 if size == "runlocal" else 32
    return _memory.config(dict(kind="memformer", num_slots=slots, segments=4), size)
