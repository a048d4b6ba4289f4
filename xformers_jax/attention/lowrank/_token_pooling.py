"""Down-sampling the token sequence: TokenLearner, and Funnel query pooling and up-sampling.

TokenLearner: Ryoo et al., "TokenLearner: What Can 8 Learned Tokens Do for Images and Videos?"
(2021). Funnel: Dai et al., "Funnel-Transformer" (2020).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._dense import dot_product_attention


def init_token_learner(key, dim: int, num_tokens: int, *, hidden: int | None = None,
                       dtype=jnp.float32):
    """The MLP ``(W1 [dim, hidden], b1 [hidden], W2 [hidden, S], b2 [S])`` that maps each
    input token to its ``S`` attention logits; ``hidden`` defaults to ``dim``."""
    name = "init_token_learner"
    dim = C.check_positive_int(name, "dim", dim)
    s = C.check_positive_int(name, "num_tokens", num_tokens)
    hidden = dim if hidden is None else C.check_positive_int(name, "hidden", hidden)
    k1, k2 = jax.random.split(key)
    return ((dim ** -0.5 * jax.random.normal(k1, (dim, hidden))).astype(dtype),
            jnp.zeros((hidden,), dtype),
            (hidden ** -0.5 * jax.random.normal(k2, (hidden, s))).astype(dtype),
            jnp.zeros((s,), dtype))


def token_learner(x, params, *, mask=None):
    """TokenLearner for one sequence: ``x [L, D] -> [S, D]``.

    Each learned token is ``z_s = mean_i sigmoid(a_s(x_i)) x_i`` with ``a = MLP(x)`` (the
    paper's spatial attention with a sigmoid); masked tokens (``mask: bool[L]`` False) are
    left out of the means.
    """
    name = "token_learner"
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be [L, D] but got shape {x.shape}")
    w1, b1, w2, b2 = params
    if w1.shape[0] != x.shape[1]:
        raise ValueError(f"{name}: params expect D={w1.shape[0]} but x has shape {x.shape}")
    f32 = C.STATS_DTYPE
    hidden = jax.nn.gelu(jnp.dot(x, w1, preferred_element_type=f32) + b1)
    weights = jax.nn.sigmoid(jnp.dot(hidden, w2.astype(f32)) + b2)
    real = jnp.ones((x.shape[0],), bool) if mask is None else C.check_kv_mask(name, mask,
                                                                               x.shape[0])
    weights = jnp.where(real[:, None], weights, 0.0)
    tokens = jnp.einsum("ls,ld->sd", weights, jnp.where(real[:, None], x, 0).astype(f32))
    return (tokens / jnp.maximum(real.sum(), 1)).astype(x.dtype)


def funnel_pool(x, stride: int = 2, *, mask=None):
    """Funnel's mean pooling along the length: ``x [L, D] -> [ceil(L / stride), D]`` (and the
    pooled mask, True where a window has a real token, when ``mask`` is given)."""
    stride = C.check_positive_int("funnel_pool", "stride", stride)
    x = jnp.asarray(x)
    real = jnp.ones((x.shape[0],), bool) if mask is None else mask
    pad = -x.shape[0] % stride
    xs = jnp.pad(x.astype(C.STATS_DTYPE), ((0, pad), (0, 0))).reshape(-1, stride, x.shape[1])
    rs = jnp.pad(real, (0, pad)).reshape(-1, stride)
    pooled = jnp.where(rs[..., None], xs, 0.0).sum(1) / jnp.maximum(rs.sum(1), 1)[:, None]
    pooled = pooled.astype(x.dtype)
    return pooled if mask is None else (pooled, rs.any(1))


def funnel_upsample(x, length: int, stride: int = 2):
    """Funnel's up-sampling: each row of ``x [M, D]`` repeated ``stride`` times, cut to
    ``length`` (the decoder adds the full-length residual from before pooling)."""
    stride = C.check_positive_int("funnel_upsample", "stride", stride)
    length = C.check_positive_int("funnel_upsample", "length", length)
    x = jnp.asarray(x)
    if x.shape[0] * stride < length:
        raise ValueError(
            f"funnel_upsample: {x.shape[0]} rows x stride {stride} cannot cover length {length}"
        )
    return jnp.repeat(x, stride, axis=0)[:length]


def funnel_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *,
    stride: int = 2,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    q_mask: Bool[Array, "q_seq"] | None = None,
    scale: float | None = None,
    key=None,
):
    """Funnel attention for one sequence and one head: pooled queries, full keys.

    ``softmax(pool(Q) K^T * scale) V`` (:func:`dot_product_attention`), giving
    ``[ceil(Lq / stride), Dv]``: the sequence is shortened ``stride`` times while every key
    still contributes. ``q_mask`` (``bool[Lq]``, default ``kv_mask`` when ``Lq == Lk``) keeps
    padding out of the pooled queries, and a pooled row of padding only is zero (the pooled
    mask is :func:`funnel_pool`'s). ``key`` is unused (the method is deterministic); it is
    accepted as the attention contract's keyword.
    """
    name = "funnel_attention"
    if causal:
        C.causal_unsupported(name, "a pooled query averages a window that includes later "
                             "positions")
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    q_mask = C.check_q_mask(name, q_mask, kv_mask, x.lq, x.lk)
    if q_mask is None:
        return dot_product_attention(funnel_pool(x.q, stride), x.k, x.v, kv_mask=kv_mask,
                                     scale=scale)
    pooled, pooled_mask = funnel_pool(x.q, stride, mask=q_mask)
    out = dot_product_attention(pooled, x.k, x.v, kv_mask=kv_mask, scale=scale)
    return C.zero_masked_rows(out, pooled_mask)
