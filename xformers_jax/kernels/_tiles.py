"""Tile-level pieces shared by the dense reference and the blocked kernels.

Everything here is a function of absolute query and key positions, so a ``[bq, bk]`` tile of
the score matrix is computed the same way whether the caller holds the whole matrix (the
reference) or one tile at a time (flash and block-sparse attention). That is what makes the
kernels agree with the reference exactly, dropout included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Softmax statistics, normalisers and accumulators are always kept in this dtype.
STATS_DTYPE = jnp.float32


def dropout_seed(key) -> jax.Array:
    """Two uint32 words drawn from ``key`` that seed the positional dropout hash."""
    return jax.random.bits(key, (2,), jnp.uint32)


def _mix32(x: jax.Array) -> jax.Array:
    # A 32-bit integer finaliser (lowbias32): a bijection whose output bits each depend on all
    # input bits, good enough for dropout decisions and cheap enough to run per score.
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def dropout_keep(seed: jax.Array, q_pos: jax.Array, k_pos: jax.Array, rate: float) -> jax.Array:
    """The keep mask for positions ``q_pos [bq, 1]`` x ``k_pos [1, bk]``: a pure hash of
    (seed, i, j), so any tiling of the matrix draws the same decisions."""
    h = _mix32(q_pos.astype(jnp.uint32) ^ seed[0])
    h = _mix32(h + jnp.uint32(0x9E3779B9) * k_pos.astype(jnp.uint32) ^ seed[1])
    threshold = np.uint32(min(int(rate * 2.0**32), 2**32 - 1))
    return h >= threshold


def dynamic_mask(kv_mask, q_seg, kv_seg):
    """The data-dependent part of a tile's mask (padding, packing), or None when there is none.

    ``kv_mask: bool[bk]``, ``q_seg: int[bq]``, ``kv_seg: int[bk]`` are the tile's slices.
    """
    mask = None
    if kv_mask is not None:
        mask = kv_mask[None, :]
    if q_seg is not None:
        same = q_seg[:, None] == kv_seg[None, :]
        mask = same if mask is None else mask & same
    return mask


def and_masks(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a & b


def safe_max(m: jax.Array) -> jax.Array:
    """A row maximum with -inf (fully masked rows) replaced by 0, so exp(s - m) stays finite."""
    return jnp.where(jnp.isneginf(m), jnp.zeros_like(m), m)


def normalise(acc: jax.Array, l: jax.Array) -> jax.Array:
    """``acc / l`` with rows that saw no key (``l == 0``) giving zeros, not NaN."""
    return acc / jnp.where(l == 0, jnp.ones_like(l), l)[..., None]


def log_sum_exp(m: jax.Array, l: jax.Array) -> jax.Array:
    """The per-row log-sum-exp of the scores from running max ``m`` and sum ``l`` (-inf for
    rows with no visible key)."""
    return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf).astype(STATS_DTYPE)
