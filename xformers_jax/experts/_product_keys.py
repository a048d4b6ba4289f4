"""Product-key memory lookup (Lample et al., 2019, "Large Memory Layers with Product Keys").

A query ``q`` (per head, width ``dk``) is split into halves ``q1, q2``; two sub-key tables of
``n`` keys each (width ``dk / 2``) index ``N = n^2`` memory slots, slot ``(i, j)`` having key
``[K1_i, K2_j]`` and score ``q1.K1_i + q2.K2_j``. The top-``k`` of the ``N`` scores lie in the
Cartesian product of each half's top-``k``, so the lookup scores ``2 n`` sub-keys and at most
``k^2`` candidates instead of ``N`` keys (fewer: :func:`_pairs`). The ``k`` selected slots'
values are averaged with the softmax of their scores; heads are summed. The value table's
gradient touches only the selected rows.

The weighted sum of the selected rows (:func:`weighted_rows`, an "embedding bag") never
materialises the ``[T, H, k, dv]`` block of gathered rows: it walks the ``H k`` slots, one
``[T, dv]`` gather at a time, and its backward scatters into the value gradient the same way.
At 4K tokens, 2 heads, k = 32 and values of width 256 that block is 268 MB, written and read
again in the forward and once more as its cotangent in the backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


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


# Batcher's odd-even merge sort for 8 inputs (19 comparators; Knuth, TAOCP vol. 3, 5.3.4).
_SORT8 = ((0, 1), (2, 3), (4, 5), (6, 7), (0, 2), (1, 3), (4, 6), (5, 7), (1, 2), (5, 6),
          (0, 4), (1, 5), (2, 6), (3, 7), (2, 4), (3, 5), (1, 2), (3, 4), (5, 6))
_GROUP = 8


def _largest_first(s):
    """``(s', index)``: each row of ``s [..., n]`` (``n`` a multiple of 8) rearranged so that
    every group of 8 neighbours' largest comes before any group's second largest, and so on;
    ``index`` maps a position of ``s'`` back to ``s``.

    XLA:CPU's ``top_k`` keeps a heap of the ``k`` best seen so far and pays for every element
    that enters it; on rows of random scores most of its time goes there (on a 2-core Xeon:
    52 ms for 8192 rows of 512 with k = 32, 8 ms on rows already sorted). Rows in this order
    put the likely winners first: 52 -> 43 ms (groups of 4: 45, of 16: 65), and the exact
    same top-k values.
    """
    *batch, n = s.shape
    g = s.reshape(*batch, n // _GROUP, _GROUP)
    vals = [g[..., i] for i in range(_GROUP)]
    base = jnp.arange(n // _GROUP, dtype=jnp.int32) * _GROUP
    idx = [jnp.broadcast_to(base + i, vals[0].shape) for i in range(_GROUP)]
    for a, b in _SORT8:  # descending: the larger goes to position a
        swap = vals[b] > vals[a]
        vals[a], vals[b] = jnp.where(swap, vals[b], vals[a]), jnp.where(swap, vals[a], vals[b])
        idx[a], idx[b] = jnp.where(swap, idx[b], idx[a]), jnp.where(swap, idx[a], idx[b])
    return jnp.stack(vals, -2).reshape(*batch, n), jnp.stack(idx, -2).reshape(*batch, n)


def _top_k(s, k: int):
    """``lax.top_k`` over the last axis, on rows rearranged by :func:`_largest_first` where
    that pays (``n`` a multiple of 8 and larger than ``k``). Equal scores may come out in
    another order than ``lax.top_k``'s (which puts the lower index first)."""
    n = s.shape[-1]
    if n % _GROUP or n <= k:
        return jax.lax.top_k(s, k)
    # Only the selection goes through the rearrangement; the values (and their gradient, a
    # scatter of k scalars per row) come from ``s`` itself.
    rows, index = _largest_first(jax.lax.stop_gradient(s))
    idx = jnp.take_along_axis(index, jax.lax.top_k(rows, k)[1], -1)
    return jnp.take_along_axis(s, idx, -1), idx


@functools.lru_cache(maxsize=None)
def _pairs(k: int) -> tuple[np.ndarray, np.ndarray]:
    """The pairs ``(i, j)`` of the two halves' sorted top-``k`` lists that can be among the
    ``k`` best sums: ``(i + 1)(j + 1) <= k``. The ``(i + 1)(j + 1)`` pairs ``(i' <= i,
    j' <= j)`` all sum at least as high as ``(i, j)``, so a pair past that bound has ``k``
    others at least as good. Lample et al.'s ``k^2`` candidates shrink to about
    ``k (1 + 1/2 + ... + 1/k)``: 119 for k = 32. Ordered by ``(i + 1)(j + 1)``, likely
    winners first, the order XLA:CPU's top_k is fastest on (4K tokens, 2 heads, k = 32, in
    one process: 126 -> 109 ms for the whole top-k)."""
    i, j = np.nonzero(np.multiply.outer(np.arange(1, k + 1), np.arange(1, k + 1)) <= k)
    order = np.lexsort((i, (i + 1) * (j + 1)))
    return i[order].astype(np.int32), j[order].astype(np.int32)


def product_key_topk(q, keys1, keys2, k: int):
    """``(scores float[T, H, k], slots int32[T, H, k])``: the top-``k`` of the ``n^2``
    product-key scores per query and head, in decreasing order (``slot = i * n + j``).

    Scores are laid out head-major (``[H, T, n]``): the sub-key products are then ``H``
    plain matmuls (2.7x faster on XLA:CPU than the ``[T, H, n]`` einsum at 4K tokens).
    Among exactly equal scores the choice and order may differ from a brute-force
    ``top_k`` over all ``n^2`` scores; each is a top-``k``.
    """
    t, h, dk = q.shape
    n = keys1.shape[1]
    qh = jnp.swapaxes(q, 0, 1)  # [H, T, dk]
    s1 = jnp.einsum("htd,hnd->htn", qh[..., : dk // 2], keys1.astype(q.dtype))
    s2 = jnp.einsum("htd,hnd->htn", qh[..., dk // 2:], keys2.astype(q.dtype))
    v1, i1 = _top_k(s1, k)
    v2, i2 = _top_k(s2, k)
    a, b = _pairs(k)
    # The candidates' scores as products with one-hot columns rather than gathers: the same
    # values exactly (one nonzero term each, at full precision), and a backward that is a
    # small matmul instead of XLA's scatter-add.
    pick = jax.lax.Precision.HIGHEST
    cand = (jnp.einsum("htk,km->htm", v1, jax.nn.one_hot(a, k, dtype=v1.dtype, axis=0),
                       precision=pick)
            + jnp.einsum("htk,km->htm", v2, jax.nn.one_hot(b, k, dtype=v2.dtype, axis=0),
                         precision=pick))
    slots = i1[..., a] * n + i2[..., b]
    best, which = jax.lax.top_k(cand, k)
    slots = jnp.take_along_axis(slots, which, -1).astype(jnp.int32)
    return jnp.swapaxes(best, 0, 1), jnp.swapaxes(slots, 0, 1)


@jax.custom_vjp
def weighted_rows(w, slots, values):
    """``w [T, S]``, ``slots int[T, S]``, ``values [N, dv]`` -> ``[T, dv]``: ``sum_s w[t, s]
    values[slots[t, s]]``, one slot at a time (no ``[T, S, dv]`` gather). Accumulates in the
    promoted dtype of ``w`` and ``values``."""
    return _weighted_rows(w, slots, values)


def _weighted_rows(w, slots, values):
    dtype = jnp.result_type(w, values)

    def body(acc, x):
        w_s, slot_s = x
        rows = jnp.take(values, slot_s, axis=0, mode="clip")  # slots are in range
        return acc + w_s[:, None].astype(dtype) * rows, None

    acc = jnp.zeros((w.shape[0], values.shape[1]), dtype)
    return jax.lax.scan(body, acc, (w.T, slots.T))[0]


def _weighted_rows_fwd(w, slots, values):
    return _weighted_rows(w, slots, values), (w, slots, values)


def _weighted_rows_bwd(res, g):
    w, slots, values = res

    def body(d_values, x):
        w_s, slot_s = x
        rows = jnp.take(values, slot_s, axis=0, mode="clip")
        dw_s = jnp.sum(rows.astype(g.dtype) * g, axis=-1)
        d_values = d_values.at[slot_s].add((w_s[:, None] * g).astype(d_values.dtype),
                                         mode="promise_in_bounds")
        return d_values, dw_s

    d_values, dw = jax.lax.scan(body, jnp.zeros_like(values), (w.T, slots.T))
    return dw.T.astype(w.dtype), None, d_values


weighted_rows.defvjp(_weighted_rows_fwd, _weighted_rows_bwd)


def product_key_lookup(q, keys1, keys2, values, k: int):
    """``q [T, H, dk]``, ``keys1, keys2 [H, n, dk/2]``, ``values [n^2, dv]`` -> ``[T, dv]``:
    ``sum_h sum_{s in top-k} softmax(scores)_s * values[s]``."""
    _check(q, keys1, keys2, values, k)
    scores, slots = product_key_topk(q, keys1, keys2, k)
    w = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(values.dtype)
    t = q.shape[0]
    return weighted_rows(w.reshape(t, -1), slots.reshape(t, -1), values)
