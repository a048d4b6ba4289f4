"""Poolingformer: sliding-window attention, then attention over a pooled memory.

Zhang et al., "Poolingformer: Long Document Modeling with Pooling Attention" (2021). Two
levels: an exact sliding window, and a second level whose keys and values are pooled (mean or
max over ``pool_size`` consecutive tokens), optionally restricted to a wider window; the two
levels' outputs are summed.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._dense import dot_product_attention
from .._exact import flash_attention
from ..patterns import Local

POOLS = ("mean", "max")


def pool_memory(x, real, pool_size: int, pool: str):
    """Pools ``x [L, D]`` over consecutive windows of ``pool_size`` real rows' positions:
    ``([M, D] float32, valid bool[M])``, ``M = ceil(L / pool_size)``; a window of padding only
    is invalid."""
    pad = -x.shape[0] % pool_size
    x = jnp.pad(x.astype(C.STATS_DTYPE), ((0, pad), (0, 0))).reshape(-1, pool_size, x.shape[1])
    real = jnp.pad(real, (0, pad)).reshape(-1, pool_size)
    count = real.sum(1)
    if pool == "mean":
        pooled = jnp.where(real[..., None], x, 0.0).sum(1) / jnp.maximum(count, 1)[:, None]
    else:
        pooled = jnp.where(real[..., None], x, -jnp.inf).max(1)
        pooled = jnp.where(count[:, None] > 0, pooled, 0.0)
    return pooled, count > 0


def poolingformer_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    q2=None,
    *,
    window: int,
    pool_size: int,
    second_window: int | None = None,
    pool: str = "mean",
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Poolingformer attention for one sequence and one head.

    ``out = SW(q, k, v) + softmax(q2 pool(k)^T * scale) pool(v)``: the first level is exact
    sliding-window attention (:func:`flash_attention` with ``Local(window, window)``), the
    second exact softmax attention (:func:`dot_product_attention`) over the pooled memory. In
    the paper the second level's queries come from the first level's output through their own
    projection; a module passes them as ``q2`` (default ``q``).

    Args:
      q: ``[L, Dk]``. k: ``[L, Dk]``. v: ``[L, Dv]`` (self-attention).
      q2: ``[L, Dk]`` second-level queries, ``q`` if None.
      window: first-level half-width: query i sees keys ``|i - j| <= window``.
      pool_size: tokens per pooled memory slot (kernel = stride).
      second_window: if given, query i sees only slots whose window overlaps
        ``[i - second_window, i + second_window]`` (cost ``O(L^2 / pool_size)`` for the mask);
        all slots otherwise.
      pool: ``"mean"`` or ``"max"``.
      causal: unsupported; raises ``NotImplementedError``.
      kv_mask: ``bool[L]``, True for real tokens; pooling skips padding.
      scale: score scale, ``1/sqrt(Dk)`` by default.

    Returns:
      ``[L, Dv]`` in q's dtype.
    """
    name = "poolingformer_attention"
    if causal:
        C.causal_unsupported(
            name, "its sliding window and pooled memory both look ahead, and a pooled slot "
            "mixes a window of tokens"
        )
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    C.check_same_length(name, x, "needs self-attention (Lq == Lk)")
    q2 = x.q if q2 is None else jnp.asarray(q2)
    if q2.shape != x.q.shape:
        raise ValueError(f"{name}: q2 must have q's shape {tuple(x.q.shape)} but got {q2.shape}")
    if pool not in POOLS:
        raise ValueError(f"{name}: pool must be one of {POOLS}, got {pool!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"{name}: window must be a non-negative integer but got {window!r}")
    p = C.check_positive_int(name, "pool_size", pool_size)
    real = jnp.ones((x.lk,), bool) if kv_mask is None else kv_mask
    first = flash_attention(x.q, x.k, x.v, pattern=Local(window, window), kv_mask=kv_mask,
                            scale=scale)
    mem_k, valid = pool_memory(x.k, real, p, pool)
    mem_v, _ = pool_memory(x.v, real, p, pool)
    bias = None
    if second_window is not None:
        w2 = C.check_positive_int(name, "second_window", second_window)
        i = jnp.arange(x.lq)[:, None]
        start = jnp.arange(mem_k.shape[0])[None, :] * p
        near = (start <= i + w2) & (start + p - 1 >= i - w2)
        bias = jnp.where(near, 0.0, -jnp.inf).astype(C.STATS_DTYPE)
    second = dot_product_attention(q2.astype(C.STATS_DTYPE), mem_k, mem_v, kv_mask=valid,
                                   bias=bias, scale=scale)
    return (first.astype(C.STATS_DTYPE) + second).astype(x.q.dtype)
