"""The Feedback Transformer (Fan et al., 2020) on byte-level streams of the standard library's
source: every layer attends to the last ``mem_len`` feedback memories (the learned mix of all
layers' states at each past position), carried across segments.

  python -m xformers_jax_experiments.train \\
      --config=xformers_jax_experiments/configs/lm/feedback.py[:runlocal] \\
      --workdir=/tmp/feedback

The model is sequential over positions (``models.FeedbackLM``: a ``lax.scan`` of ``L`` steps per
segment), so a step costs far more than Transformer-XL's at the same size. Memory 256
(``runlocal``: 64); sizes in ``_memory.py``.
"""

from xformers_jax_experiments.configs.lm import _memory


def get_config(arg=None):
    size = "runlocal" if "runlocal" in (arg or "").split(",") else None
    return _memory.config(dict(kind="feedback", mem_len=256), size)
