"""Product-key memory lookup (Lample et al., 2019, "Large Memory Layers with Product Keys").

A query ``q`` (per head, width ``dk``) is split into halves ``q1, q2``; two sub-key tables of
``n`` keys each (width ``dk / 2``) index ``N = n^2`` memory slots, slot ``(i, j)`` having key
``[K1_i, K2_j]`` and score ``q1.K1_i + q2.K2_j``. The top-``k`` of the ``N`` scores lie in the
Cartesian product of each half's top-``k``, so the lookup scores ``2 n`` sub-keys and ``k^2``
candidates instead of ``N`` keys. The ``k`` selected slots' values are averaged with the
softmax of their scores; heads are summed. The value table's gradient touches only the
selected rows (a gather).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check(q, keys1, keys2, values, k):
    if q.ndim != 3:
        raise ValueError(f"product_key_lookup: q must be [T, heads, dk], got {q.shape}")
    t, h, dk = q.shape
    if dk % 2:
        raise ValueError(f"product_key_lookup: the query width {dk} must be even")
    want = (h, keys1.shape[1], dk // 2)
    if keys1.shape != want or keys2.shape != want:
        raise ValueError(f"product_key_lookup: sub-key tables must be [heads, n, dk/2] = "
                         f"{want}, got {keys1.shape} and {keys2.shape}")
    n = keys1.shape[1]
    if values.ndim != 2 or values.shape[0] != n * n:
        raise ValueError(f"product_key_lookup: values must be [n^2 = {n * n}, dv], got "
                         f"{values.shape}")
    if not 1 <= k <= n:
        raise ValueError(f"product_key_lookup: k must be in [1, n = {n}], got {k}")


def product_key_topk(q, keys1, keys2, k: int):
    """``(scores float[T, H, k], slots int32[T, H, k])``: the top-``k`` of the ``n^2``
    product-key scores per query and head, in decreasing order (``slot = i * n + j``)."""
    t, h, dk = q.shape
    n = keys1.shape[1]
    q1, q2 = q[..., : dk // 2], q[..., dk // 2:]
    s1 = jnp.einsum("thd,hnd->thn", q1, keys1.astype(q.dtype))
    s2 = jnp.einsum("thd,hnd->thn", q2, keys2.astype(q.dtype))
    v1, i1 = jax.lax.top_k(s1, k)
    v2, i2 = jax.lax.top_k(s2, k)
    cand = (v1[..., :, None] + v2[..., None, :]).reshape(t, h, k * k)
    slots = (i1[..., :, None] * n + i2[..., None, :]).reshape(t, h, k * k)
    best, which = jax.lax.top_k(cand, k)
    return best, jnp.take_along_axis(slots, which, -1).astype(jnp.int32)


def product_key_lookup(q, keys1, keys2, values, k: int):
    """``q [T, H, dk]``, ``keys1, keys2 [H, n, dk/2]``, ``values [n^2, dv]`` -> ``[T, dv]``:
    ``sum_h sum_{s in top-k} softmax(scores)_s * values[s]``."""
    _check(q, keys1, keys2, values, k)
    scores, slots = product_key_topk(q, keys1, keys2, k)
    w = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(values.dtype)
    rows = values[slots]  # [T, H, k, dv]
    return jnp.einsum("thk,thkv->tv", w, rows)
