"""Tile-level pieces shared by the dense reference and the blocked kernels.

Everything here is a function of absolute query and key positions, so a ``[bq, bk]`` tile of
the score matrix is computed the same way whether the caller holds the whole matrix (the
reference) or one tile at a time (flash and block-sparse attention). That is what makes the
kernels agree with the reference exactly, dropout included.

The online-softmax step and finish, the recomputing backward's tile gradients and the merge of
partial attentions by their log-sum-exps live here once: the XLA tiled kernel, the Pallas
kernels (inside kernel bodies), ring attention and the chunked attentions (LSH, Long-Short)
all call these functions.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Softmax statistics, normalisers and accumulators are always kept in this dtype.
STATS_DTYPE = jnp.float32


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """What every tiled kernel knows statically about one call's tiles: the score scale and
    which optional dynamic masks (a key padding mask, segment ids) are present. The XLA tiled
    kernel and the Pallas kernels extend it with their own static fields."""

    scale: float
    has_kv_mask: bool
    has_segments: bool


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


def select_real_keys(x: jax.Array, kv_mask) -> jax.Array:
    """``x [Lk, D]`` with the rows of masked keys replaced by zeros, by a select: a masked
    key's probability is 0, but ``0 * nan`` and ``0 * inf`` are NaN, so a product with its
    key or value (``p v``, ``dO v^T``, ``ds k``) must never see its content. ``O(Lk D)``,
    once per call, not per tile."""
    if kv_mask is None:
        return x
    return jnp.where(kv_mask[:, None], x, jnp.zeros((), x.dtype))


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


def pad_to(x: jax.Array, length: int, axis: int = 0, value=0) -> jax.Array:
    """``x`` padded with ``value`` at the end of ``axis`` to ``length`` (unchanged if already)."""
    pad = length - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


# The online softmax (Milakov & Gimelshein, 2018) as FlashAttention runs it tile by tile (Dao
# et al., 2022). These are plain jnp functions of tiles: the XLA tiled kernel calls them inside
# ``lax.scan`` bodies and the Pallas kernels inside kernel bodies (Triton and Mosaic lower
# every operation used here). Per-row statistics are ``[bq, 1]`` columns, so nothing needs a
# reshape or a 1-D slice inside a kernel.


def online_step(s: jax.Array, m_old: jax.Array, l_old: jax.Array, acc_old: jax.Array,
                attend: Callable[[jax.Array], jax.Array], row_max=None):
    """One online-softmax update of a query block by a tile of scores ``s [bq, bk]`` (float32,
    masked entries -inf).

    ``m, l: [bq, 1]`` are the running maximum and normaliser, ``acc [bq, Dv]`` the unnormalised
    output; ``attend(p)`` returns ``p @ v_tile`` in float32 for the tile's unnormalised
    probabilities ``p [bq, bk]`` (where a caller applies dropout and casts). ``row_max``: the
    tile's row maximum ``[bq, 1]`` when the caller has it in a cheaper form (None: taken from
    ``s``). Returns ``(m, l, acc)``.
    """
    if row_max is None:
        row_max = s.max(axis=-1, keepdims=True)
    m_new = jnp.maximum(m_old, row_max)
    m_safe = safe_max(m_new)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m_old - m_safe)
    l_new = alpha * l_old + p.sum(axis=-1, keepdims=True)
    acc_new = alpha * acc_old + attend(p)
    return m_new, l_new, acc_new


def finish(m: jax.Array, l: jax.Array, acc: jax.Array):
    """``(out f32[bq, Dv], lse f32[bq, 1])`` from the final online-softmax state (``m, l:
    [bq, 1]``); rows that saw no key give zeros and ``lse = -inf``."""
    return acc / jnp.where(l == 0, jnp.ones_like(l), l), log_sum_exp(m, l)


def backward_stats(out: jax.Array, lse: jax.Array, d_out: jax.Array, d_lse=None):
    """The per-row inputs of the recomputing backward pass: ``(lse', delta)``, both f32[Lq].

    ``delta = rowsum(dO * O) - d_lse``: since ``d lse_i / d s_ij = p_ij``, a cotangent on the
    log-sum-exp enters every ``ds_ij`` where ``-delta_i`` does (``d_lse=None``: none).
    ``lse'`` is ``lse`` with -inf (rows that saw no key) replaced by +inf, so every
    ``exp(s - lse')`` of such a row is 0.
    """
    delta = jnp.sum(d_out.astype(STATS_DTYPE) * out.astype(STATS_DTYPE), axis=-1)
    if d_lse is not None:
        delta = delta - d_lse.astype(STATS_DTYPE)
    return jnp.where(jnp.isneginf(lse), jnp.inf, lse), delta


def tile_probs(s: jax.Array, lse: jax.Array) -> jax.Array:
    """A tile's softmax probabilities recomputed from the saved log-sum-exp: ``exp(s - lse)``
    (``lse`` from :func:`backward_stats`, shaped to broadcast along the tile's query axis)."""
    return jnp.exp(s - lse)


def score_grad(p: jax.Array, dp: jax.Array, delta: jax.Array) -> jax.Array:
    """``ds = p * (dp - delta)``: the softmax backward of one tile, ``dp = dO v^T`` (after
    dropout, if any), ``delta`` from :func:`backward_stats` shaped like ``lse``."""
    return p * (dp - delta)


def merge_weighted(outs: Sequence[jax.Array], weights: Sequence[jax.Array]) -> jax.Array:
    """``sum_r w_r out_r / sum_r w_r`` in float32 for ``outs [L, Dv]`` and weights ``[L]``;
    rows whose weights are all 0 give zeros."""
    num = total = None
    for o, w in zip(outs, weights):
        term = w[..., None] * o.astype(STATS_DTYPE)
        num = term if num is None else num + term
        total = w if total is None else total + w
    return normalise(num, total)


def merge_all_by_lse(outs: Sequence[jax.Array], lses: Sequence[jax.Array]):
    """One softmax attention over the union of disjoint key sets, from each set's normalised
    output ``out_r [L, Dv]`` and log-sum-exp ``lse_r f32[L]`` (the blockwise merge of
    FlashAttention, Dao et al., 2022, and of ring attention, Liu et al., 2023).

    Each part is weighted by its share of the total normaliser, ``exp(lse_r - lse)``. Returns
    ``(out f32[L, Dv], lse f32[L])``; rows no part saw (every ``lse_r = -inf``) give zeros and
    ``-inf``. The shift is a stopped maximum (the result does not depend on it), so gradients
    flow through the parts' outputs and log-sum-exps only. ``outs``/``lses`` may be sequences
    or arrays with the parts on the leading axis.
    """
    outs, lses = list(outs), [x.astype(STATS_DTYPE) for x in lses]
    m = lses[0]
    for x in lses[1:]:
        m = jnp.maximum(m, x)
    m = jax.lax.stop_gradient(safe_max(m))
    weights = [jnp.exp(x - m) for x in lses]
    total = weights[0]
    for w in weights[1:]:
        total = total + w
    return merge_weighted(outs, weights), log_sum_exp(m, total)


def merge_by_lse(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array):
    """:func:`merge_all_by_lse` of two parts: ``(out f32[L, Dv], lse f32[L])``."""
    return merge_all_by_lse((out_a, out_b), (lse_a, lse_b))
