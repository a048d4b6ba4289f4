"""Informer's ProbSparse attention: only the most "peaked" queries attend.

Zhou et al., "Informer: Beyond Efficient Transformer for Long Sequence Time-Series Forecasting"
(2021). The sparsity measure ``M(q_i) = max_j s_ij - mean_j s_ij`` (an approximation of the
KL divergence of the query's attention from uniform), estimated on a random sample of keys,
picks the top-u queries; they get exact softmax attention, the others the mean of the values
(the output of uniform attention).

Informer's decoder also has a "causal" form (lazy queries get the mean of the values up to
their position). It is not offered here: choosing the top-u queries ranks every query against
later ones, whose measures read later keys, so whether query i attends (and so its output)
depends on the future. The contract forbids that, so ``causal=True`` raises.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .. import _contract as C
from .._dense import dot_product_attention


def probsparse_attention(q, k, v, *, key, factor: float = 5.0, causal: bool = False,
                         kv_mask=None, scale: float | None = None):
    """ProbSparse attention for one sequence and one head.

    ``u = min(Lq, ceil(factor * ln Lq))`` queries are chosen by the measure over
    ``min(Lk, ceil(factor * ln Lk))`` keys sampled (with replacement) from ``key``; the chosen
    rows are exact softmax attention (:func:`dot_product_attention`), the rest the mean of the
    real values. With ``u == Lq`` it is exact softmax attention.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      key: PRNG key for the key sample (required).
      factor: Informer's sampling factor ``c``.
      causal: unsupported; raises ``NotImplementedError`` (see the module docstring).
      kv_mask: ``bool[Lk]``, True for real keys.
      scale: score scale, ``1/sqrt(Dk)`` by default.

    Returns:
      ``[Lq, Dv]`` in q's dtype.
    """
    name = "probsparse_attention"
    if causal:
        C.causal_unsupported(
            name, "the top-u query selection ranks each query against later queries, whose "
            "sparsity measures read later keys, so whether a query attends depends on the future"
        )
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    if key is None:
        raise ValueError(f"{name}: needs an explicit PRNG `key` for its sample of keys")
    if not factor > 0:
        raise ValueError(f"{name}: factor must be positive but got {factor}")
    scale = C.resolve_scale(x.dk, scale)
    f32 = C.STATS_DTYPE
    n_top = min(x.lq, math.ceil(factor * math.log(max(x.lq, 2))))
    n_sample = min(x.lk, math.ceil(factor * math.log(max(x.lk, 2))))
    real = jnp.ones((x.lk,), bool) if kv_mask is None else kv_mask

    sample = jax.random.randint(key, (n_sample,), 0, x.lk)
    s = jnp.einsum("qd,sd->qs", x.q, x.k[sample], preferred_element_type=f32) * scale
    seen = jnp.broadcast_to(real[sample][None, :], s.shape)
    n_seen = seen.sum(1)
    measure = jnp.where(seen, s, -jnp.inf).max(1) - jnp.where(seen, s, 0.0).sum(1) / jnp.maximum(
        n_seen, 1)
    measure = jax.lax.stop_gradient(jnp.where(n_seen > 0, measure, -jnp.inf))
    top = jax.lax.top_k(measure, n_top)[1]

    v_real = jnp.where(real[:, None], x.v.astype(f32), 0.0)
    lazy = jnp.broadcast_to(v_real.sum(0) / jnp.maximum(real.sum(), 1), (x.lq, x.dv))
    active = dot_product_attention(x.q[top], x.k, x.v, kv_mask=kv_mask, scale=scale)
    return lazy.at[top].set(active.astype(f32)).astype(x.q.dtype)
