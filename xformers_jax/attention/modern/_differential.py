"""Differential attention: the difference of two softmax maps (Ye et al., 2024, "Differential
Transformer", Eqs. 1-3).

Each head splits its query and key into halves ``[Q1; Q2]``, ``[K1; K2]`` (``d`` channels
each) and attends with

    DiffAttn(X) = (softmax(Q1 K1^T / sqrt(d)) - lambda softmax(Q2 K2^T / sqrt(d))) V,
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init,
    lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1))          (l: the layer's 1-based depth),

then normalises each head on its own (RMSNorm, the paper's GroupNorm over heads) and scales it
by ``1 - lambda_init``. The second map cancels the attention noise both maps share. The
paper's norm has a per-channel gain; as every head's output goes through ``W_O`` next, that
gain is a rescaling of ``W_O``'s rows and is left to it here.

Both maps run on the tiled kernel (``flash_attention``); the combination is elementwise, so
time and memory are two flash calls'.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ...kernels import STATS_DTYPE
from .. import _contract as C
from .._dense import dot_product_attention
from .._exact import flash_attention

_EPS = 1e-5  # the paper's RMSNorm epsilon


def lambda_init_for(layer_index: int) -> float:
    """The paper's ``lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1))`` for the ``l``-th layer
    (1-based): 0.2 in the first layer, towards 0.8 in deep ones."""
    if isinstance(layer_index, bool) or not isinstance(layer_index, int) or layer_index < 1:
        raise ValueError(f"differential attention: layer_index is the layer's 1-based depth, got "
                         f"{layer_index!r}")
    return 0.8 - 0.6 * math.exp(-0.3 * (layer_index - 1))


def differential_lambda(lq1, lk1, lq2, lk2, lambda_init: float) -> jax.Array:
    """The reparametrised ``lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` from the
    four learned vectors ``[d]`` (Ye et al., 2024, Eq. 2), float32."""
    def f(a, b):
        return jnp.exp(jnp.dot(a.astype(STATS_DTYPE), b.astype(STATS_DTYPE)))

    return f(lq1, lk1) - f(lq2, lk2) + lambda_init


def _halves(name, q, k):
    dk = q.shape[-1]
    if dk % 2:
        raise ValueError(f"{name}: the query/key width splits into two halves (Q1, Q2), so it "
                         f"must be even; got q{tuple(q.shape)}, k{tuple(k.shape)}")
    d = dk // 2
    return (q[:, :d], k[:, :d]), (q[:, d:], k[:, d:]), d


def _head_norm(a1, a2, lam, lambda_init):
    o = a1.astype(STATS_DTYPE) - lam * a2.astype(STATS_DTYPE)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + _EPS)
    return (1.0 - lambda_init) * o


def differential_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    lam: Float[Array, ""],
    *,
    lambda_init: float = 0.8,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale: float | None = None,
    key=None,
    block_q: int | None = None,
    block_k: int | None = None,
    implementation: str | None = None,
) -> Float[Array, "q_seq v_dim"]:
    """Differential attention of one head (Ye et al., 2024), both maps on the tiled kernel.

    Args:
      q: ``[Lq, 2d]`` (``Q1`` the first ``d`` channels, ``Q2`` the rest). k: ``[Lk, 2d]``.
      v: ``[Lk, Dv]``.
      lam: the scalar ``lambda`` (:func:`differential_lambda` of the learned vectors).
      lambda_init: the ``lambda_init`` of this layer (:func:`lambda_init_for`); the output is
        scaled by ``1 - lambda_init``.
      causal, kv_mask, key: the contract's. segment_ids: packed-sequence ids (``int[L]`` or a
        ``(q, kv)`` pair, as ``flash_attention``'s): both maps stay inside each document.
      scale: ``1/sqrt(d)`` by default (the half width).
      block_q, block_k, implementation: the tiled kernel's (``flash_attention``).

    Returns:
      ``[Lq, Dv]`` in q's dtype: ``(1 - lambda_init) RMSNorm(A1 V - lambda A2 V)``. With
      ``lam = 0`` it is the normalised softmax attention of ``Q1, K1``.
    """
    name = "differential_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    (q1, k1), (q2, k2), d = _halves(name, x.q, x.k)
    scale = C.resolve_scale(d, scale)
    kw = {"causal": causal, "kv_mask": kv_mask, "segment_ids": segment_ids, "scale": scale,
          "block_q": block_q,
          "block_k": block_k, "implementation": implementation}
    a1 = flash_attention(q1, k1, x.v, **kw)
    a2 = flash_attention(q2, k2, x.v, **kw)
    return _head_norm(a1, a2, lam, lambda_init).astype(q.dtype)


def differential_attention_reference(q, k, v, lam, *, lambda_init: float = 0.8,
                                     causal: bool = False, kv_mask=None, segment_ids=None,
                                     scale=None):
    """:func:`differential_attention` as the paper writes it: the two ``[Lq, Lk]`` softmax
    maps formed densely, subtracted, then applied to ``V`` (for tests)."""
    name = "differential_attention_reference"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    (q1, k1), (q2, k2), d = _halves(name, x.q, x.k)
    scale = C.resolve_scale(d, scale)
    kw = {"causal": causal, "kv_mask": kv_mask, "segment_ids": segment_ids, "scale": scale,
          "return_weights": True}
    _, p1 = dot_product_attention(q1, k1, x.v, **kw)
    _, p2 = dot_product_attention(q2, k2, x.v, **kw)
    o = (p1.astype(STATS_DTYPE) - lam * p2.astype(STATS_DTYPE)) @ x.v.astype(STATS_DTYPE)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + _EPS)
    return ((1.0 - lambda_init) * o).astype(q.dtype)
