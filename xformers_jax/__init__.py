"""xformers_jax: a pure-JAX functional research framework for efficient Transformers."""

from . import attention as attention
from . import experts as experts
from . import mixers as mixers

__version__ = "0.1.0"
