"""ERNIE-Doc's enhanced recurrence (Ding et al., 2021) on byte-level streams of the standard
library's source: each layer's memory is its own output on the previous segment. Evaluation memory 1024, also
reported at 0 and 256 (``bits_per_byte_mem0``, ``bits_per_byte_mem256``).

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lm/ernie_doc.py[:runlocal] \
      --workdir=/tmp/ernie

The retrospective feed (``models.retrospective_feed``) reads a document twice and so sees later
text: it is for document understanding, not this next-byte task. Sizes in ``_memory.py``.
"""

from xformers_jax_experiments.configs.lm import _memory


def get_config(arg=None):
    size = "runlocal" if "runlocal" in (arg or "").split(",") else None
    return _memory.config(dict(kind="ernie", mem_len=256, eval_mem_len=1024), size,
                          eval_mem_lens=(0, 256))
