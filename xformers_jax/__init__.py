"""xformers_jax: a pure-JAX functional research framework for efficient Transformers."""

from . import attention as attention

__version__ = "0.1.0"
