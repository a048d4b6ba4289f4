"""A fingerprint of each array of a checkpoint, computed where the array lives.

``fingerprints(tree)`` maps each array of a nested dict (``parallel.checkpoint_tree``'s form)
to 16 hex digits: two 32-bit sums over the array's bits read as unsigned words ``w[i]``,
``sum(w[i] * (2i + 1))`` and ``sum(mix(w[i] + i * 0x9E3779B9))`` (``mix``: the 32-bit
finaliser of MurmurHash3), modulo 2**32. The first changes with any single changed word (an
odd factor is invertible modulo 2**32), the second with moved or swapped words; a random
change of many words goes unseen with probability about 2**-64. Integer sums do not depend on
the order of addition, so the value is the same for any sharding, any mesh and any process
count: it is computed by one jitted reduction on the devices holding the array (every
process calls it; the result is replicated), and a checkpoint written on 8 devices verifies
when restored onto 1. Arrays of more than 2**32 words reuse indices (the sums stay exact).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..parallel import path_string

_GOLDEN = np.uint32(0x9E3779B9)


def _words(x: jax.Array) -> jax.Array:
    """``x``'s bits as a flat uint32 array (narrower dtypes: one word per element)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
    if x.dtype.itemsize < 1 or jnp.dtype(x.dtype).name in ("int4", "uint4", "int2", "uint2"):
        x = x.astype(jnp.int8)  # sub-byte types: one value per byte
    size = x.dtype.itemsize
    if size >= 4:
        return lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)


def _mix(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _sums(x):
    w = _words(x)
    i = lax.iota(jnp.uint32, w.size)
    return (jnp.sum(w * (np.uint32(2) * i + np.uint32(1)), dtype=jnp.uint32),
            jnp.sum(_mix(w + i * _GOLDEN), dtype=jnp.uint32))


@jax.jit
def _tree_sums(tree):
    return jax.tree.map(_sums, tree)


def _scalar(x) -> int:
    # A scalar output is replicated; in a multi-process run each process reads its own copy.
    return int(np.asarray(x.addressable_data(0) if hasattr(x, "addressable_data") else x))


def fingerprints(tree: dict) -> dict[str, str]:
    """``{path: 16 hex digits}`` for each array of the nested dict ``tree`` (paths as
    ``parallel.path_string`` writes them, ``model/layers/0/wq``)."""
    sums = _tree_sums(tree)
    out = {}
    for path, pair in jax.tree_util.tree_flatten_with_path(
            sums, is_leaf=lambda n: isinstance(n, tuple))[0]:
        a, b = (_scalar(s) for s in pair)
        out[path_string(path)] = f"{a:08x}{b:08x}"
    return out
