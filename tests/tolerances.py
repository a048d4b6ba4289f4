"""One tolerance table per dtype, for comparing a kernel against its reference.

Never loosen an entry to make a test pass: a test that needs more slack is telling you about a
bug or about a comparison that should be made differently (e.g. in float32).
"""

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


def assert_close(actual, expected, table=EXACT, dtype=None, err_msg=""):
    """Compares in float32 with the tolerance of ``dtype`` (default: actual's dtype)."""
    dtype = dtype or jnp.asarray(actual).dtype
    np.testing.assert_allclose(
        np.asarray(jnp.asarray(actual, jnp.float32)),
        np.asarray(jnp.asarray(expected, jnp.float32)),
        err_msg=err_msg,
        **tol(table, dtype),
    )
