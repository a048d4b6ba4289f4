"""One small encoder classifier shared by the compression tests (built once per process: its
construction compiles dozens of small initialisation programs)."""

import functools

import jax

from xformers_jax import models


@functools.lru_cache(maxsize=1)
def small_classifier():
    """``EncoderClassifier``: 3 classes, dim 16, 2 layers, 2 heads, MLP 32, vocab 12, CLS."""
    return models.EncoderClassifier(3, 16, 2, 2, 32, vocab_size=12, max_len=17,
                                key=jax.random.PRNGKey(0))


def fast_jit(f):
    """``f(*args)`` jitted at XLA's lowest backend optimisation level (compiles faster; the
    tests' shapes are tiny), for arguments holding Equinox modules."""
    import equinox as eqx

    def run(*args):
        arrays, static = eqx.partition(args, eqx.is_array)
        jitted = jax.jit(lambda a: f(*eqx.combine(a, static)),
                         compiler_options={"xla_backend_optimization_level": 0})
        return jitted(arrays)

    return run
