"""For small-shape tests, where compile time dominates: models built inside one compiled
program (eager initialisation compiles every random draw's shape separately) and functions
compiled at XLA's optimisation level 0 (same results, fewer compile passes)."""

import jax

LEVEL0 = {"xla_backend_optimization_level": 0}


def jit0(f, **kwargs):
    """``jax.jit`` at optimisation level 0 (modules pass as pytrees of arrays)."""
    return jax.jit(f, compiler_options=LEVEL0, **kwargs)


def build(make, seed: int):
    """``make(key=PRNGKey(seed))`` run as one compiled program."""
    return jit0(lambda k: make(key=k))(jax.random.PRNGKey(seed))
