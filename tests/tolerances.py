"""One tolerance table per dtype, for comparing a kernel against its reference.

Never loosen an entry to make a test pass: a test that needs more slack is telling you about a
bug or about a comparison that should be made differently (e.g. in float32).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np

# (atol, rtol) for outputs and for gradients of exact kernels against the dense reference.
EXACT = {
    jnp.float32: dict(atol=2e-5, rtol=2e-5),
    jnp.bfloat16: dict(atol=3e-2, rtol=3e-2),
    jnp.float16: dict(atol=4e-3, rtol=4e-3),
}
EXACT_GRAD = {
    jnp.float32: dict(atol=1e-4, rtol=1e-4),
    jnp.bfloat16: dict(atol=8e-2, rtol=8e-2),
    jnp.float16: dict(atol=1e-2, rtol=1e-2),
}


def tol(table, dtype):
    return table[jnp.dtype(dtype).type]


def _float32(x):
    # One array (anything jnp.asarray takes, as before: lists are stacked) or a pytree of them.
    try:
        return np.asarray(jnp.asarray(x, jnp.float32))
    except (TypeError, ValueError):
        return jax.tree.map(lambda leaf: np.asarray(jnp.asarray(leaf, jnp.float32)), x)


def assert_close(actual, expected, table=EXACT, dtype=None, err_msg=""):
    """Compares in float32 with the tolerance of ``dtype`` (default: actual's dtype, or its
    first floating leaf's). ``actual`` and ``expected`` are arrays or pytrees of arrays (e.g.
    gradients); ``chex.assert_trees_all_close`` names the first leaf that differs."""
    if dtype is None:
        leaves = [jnp.asarray(x) for x in jax.tree.leaves(actual)]
        dtype = next((x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)),
                     jnp.asarray(leaves[0]).dtype if len(leaves) == 1 else jnp.float32)
    chex.assert_trees_all_close(_float32(actual), _float32(expected),
                                custom_message=err_msg or None, **tol(table, dtype))
