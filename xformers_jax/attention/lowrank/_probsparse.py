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
import numpy as np
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._dense import dot_product_attention


def _counts(factor: float, length: int) -> np.ndarray:
    """``min(n, ceil(factor * ln n))`` for every ``n`` in ``0..length``: Informer's number of
    active queries (and of sampled keys) for ``n`` real tokens, as a static table (computed in
    Python once, indexed by the traced count)."""
    return np.array([min(n, math.ceil(factor * math.log(max(n, 2)))) for n in range(length + 1)],
                    np.int32)


def probsparse_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *,
    key,
    factor: float = 5.0,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    q_mask: Bool[Array, "q_seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "q_seq v_dim"]:
    """ProbSparse attention for one sequence and one head.

    With ``n_q`` real queries and ``n_k`` real keys, ``u = min(n_q, ceil(factor * ln n_q))``
    queries are chosen by the measure over ``min(n_k, ceil(factor * ln n_k))`` real keys
    sampled (with replacement) from ``key``; the chosen rows are exact softmax attention
    (:func:`dot_product_attention`), the other real rows the mean of the real values. With
    ``u == n_q`` it is exact softmax attention.

    Padding changes nothing: the counts are those of the real tokens, the s-th sampled key is
    drawn from its own ``fold_in(key, s)`` as a rank among the real keys (not a position in the
    padded sequence), padded queries are never chosen, and their outputs are zeros. Shapes stay
    static: the top ``u`` are taken from the top ``ceil(factor * ln Lq)`` by a traced count.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      key: PRNG key for the key sample (required).
      factor: Informer's sampling factor ``c``.
      causal: unsupported; raises ``NotImplementedError`` (see the module docstring).
      kv_mask: ``bool[Lk]``, True for real keys.
      q_mask: ``bool[Lq]``, True for real queries (default: ``kv_mask`` when ``Lq == Lk``).
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
    q_mask = C.check_q_mask(name, q_mask, kv_mask, x.lq, x.lk)
    if key is None:
        raise ValueError(f"{name}: needs an explicit PRNG `key` for its sample of keys")
    if not factor > 0:
        raise ValueError(f"{name}: factor must be positive but got {factor}")
    scale = C.resolve_scale(x.dk, scale)
    f32 = C.STATS_DTYPE
    top_counts, sample_counts = _counts(factor, x.lq), _counts(factor, x.lk)
    real_q = jnp.ones((x.lq,), bool) if q_mask is None else q_mask
    real_k = jnp.ones((x.lk,), bool) if kv_mask is None else kv_mask
    k_order, n_k = C.real_positions(kv_mask, x.lk)
    n_top = jnp.asarray(top_counts)[jnp.sum(real_q)]
    n_sample = jnp.asarray(sample_counts)[n_k]

    # The s-th sample: a rank among the real keys, from its own key.
    ranks = jax.vmap(lambda kk: jax.random.randint(kk, (), 0, jnp.maximum(n_k, 1)))(
        C.rank_keys(key, int(sample_counts[-1])))
    sample = k_order[ranks]
    drawn = jnp.arange(ranks.shape[0]) < n_sample
    s = jnp.einsum("qd,sd->qs", x.q, x.k[sample], preferred_element_type=f32) * scale
    measure = jnp.where(drawn, s, -jnp.inf).max(1) - jnp.where(drawn, s, 0.0).sum(1) / (
        jnp.maximum(n_sample, 1))
    measure = jnp.where(real_q & (n_sample > 0), measure, -jnp.inf)
    top = jax.lax.top_k(jax.lax.stop_gradient(measure), int(top_counts[-1]))[1]
    chosen = jnp.arange(top.shape[0]) < n_top

    v_real = jnp.where(real_k[:, None], x.v.astype(f32), 0.0)
    lazy = jnp.broadcast_to(v_real.sum(0) / jnp.maximum(n_k, 1), (x.lq, x.dv))
    active = dot_product_attention(x.q[top], x.k, x.v, kv_mask=kv_mask, scale=scale)
    out = lazy.at[top].set(jnp.where(chosen[:, None], active.astype(f32), lazy[top]))
    return C.zero_masked_rows(out.astype(x.q.dtype), q_mask)
