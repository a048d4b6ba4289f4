"""Clustered and improved clustered attention: queries grouped into prototypes.

Vyas, Katharopoulos, Fleuret, "Fast Transformers with Clustered Attention" (2020). Queries
are hashed to bits by random hyperplanes, grouped by k-means under the Hamming distance, and
each cluster's centroid attends for all its members. The improved form recomputes each
cluster's top-k keys exactly for every member and rescales them by the mass the centroid gave
them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._dense import dot_product_attention


def cluster_queries(q, num_clusters: int, *, key, bits: int, iterations: int, q_mask=None):
    """Hamming k-means on LSH codes of ``q [Lq, Dk]``.

    Returns ``(assignment int32[Lq], centroids [C, Dk] float32)``: centroids are the means of
    their real (``q_mask``) members in the original space; an empty cluster has a zero
    centroid. Centroids start at ``C`` distinct real queries drawn uniformly from ``key``: one
    uniform number per real query, indexed by its rank among the real queries
    (:func:`~xformers_jax.attention._contract.rank_keys`), and the ``C`` smallest win, so the
    clusters of a padded sequence are those of its real queries alone, whatever the padding.
    With fewer real queries than clusters, the extra clusters start as copies of the first
    (argmin then gives them no member until they move).
    """
    lq, dk = q.shape
    k_planes, k_init = jax.random.split(key)
    planes = jax.random.normal(k_planes, (dk, bits), C.STATS_DTYPE)
    code = (q.astype(C.STATS_DTYPE) @ planes > 0).astype(C.STATS_DTYPE)
    real = jnp.ones((lq,), bool) if q_mask is None else q_mask
    weight = real.astype(C.STATS_DTYPE)
    draws = jax.vmap(jax.random.uniform)(C.rank_keys(k_init, lq))
    rank = jnp.maximum(jnp.cumsum(real) - 1, 0)
    start = jax.lax.top_k(-jnp.where(real, draws[rank], jnp.inf), num_clusters)[1]
    centre = jnp.where(real[start][:, None], code[start], code[start[0]])

    def assign(centre):
        hamming = code @ (1.0 - centre).T + (1.0 - code) @ centre.T
        return jnp.argmin(hamming, axis=1).astype(jnp.int32)

    def lloyd(centre, _):
        members = jax.nn.one_hot(assign(centre), num_clusters, dtype=C.STATS_DTYPE)
        members = members * weight[:, None]
        size = members.sum(0)
        majority = (members.T @ code > 0.5 * size[:, None]).astype(C.STATS_DTYPE)
        return jnp.where(size[:, None] > 0, majority, centre), None

    centre = jax.lax.scan(lloyd, centre, None, length=iterations)[0]
    cluster = assign(centre)
    members = jax.nn.one_hot(cluster, num_clusters, dtype=C.STATS_DTYPE) * weight[:, None]
    centroids = (members.T @ q.astype(C.STATS_DTYPE)) / jnp.maximum(members.sum(0), 1.0)[:, None]
    return cluster, centroids


def _checked(name, q, k, v, causal, kv_mask, q_mask, num_clusters, bits, iterations, key):
    if causal:
        C.causal_unsupported(
            name, "a cluster's centroid averages queries from every position, so it shares "
            "one attention distribution between past and future queries"
        )
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    q_mask = C.check_q_mask(name, q_mask, kv_mask, x.lq, x.lk)
    n = C.check_positive_int(name, "num_clusters", num_clusters)
    if n > x.lq:
        raise ValueError(
            f"{name}: num_clusters={n} exceeds the {x.lq} queries of q{tuple(x.q.shape)}"
        )
    C.check_positive_int(name, "bits", bits)
    C.check_positive_int(name, "iterations", iterations)
    if key is None:
        raise ValueError(f"{name}: needs an explicit PRNG `key` for its hashing hyperplanes")
    return x, kv_mask, q_mask


def clustered_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *,
    num_clusters: int,
    key,
    bits: int = 32,
    iterations: int = 10,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    q_mask: Bool[Array, "q_seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "q_seq v_dim"]:
    """Clustered attention for one sequence and one head.

    Each query gets the output of its cluster's centroid: exact softmax attention
    (:func:`dot_product_attention`) of ``C`` centroids over all keys, ``O(Lq bits + C Lk)``.
    With one query per cluster it is exact softmax attention.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      num_clusters: ``C <= Lq``.
      key: PRNG key for the hyperplanes and the initial centroids (required).
      bits: LSH code length.
      iterations: Lloyd iterations of the Hamming k-means.
      causal: unsupported; raises ``NotImplementedError``.
      kv_mask: ``bool[Lk]``, True for real keys.
      q_mask: ``bool[Lq]``, True for real queries (default: ``kv_mask`` when ``Lq == Lk``);
        masked queries shape no centroid and their outputs are zeros.
      scale: score scale, ``1/sqrt(Dk)`` by default.

    Returns:
      ``[Lq, Dv]`` in q's dtype.
    """
    name = "clustered_attention"
    x, kv_mask, q_mask = _checked(name, q, k, v, causal, kv_mask, q_mask, num_clusters, bits,
                                  iterations, key)
    cluster, centroids = cluster_queries(x.q, num_clusters, key=key, bits=bits,
                                         iterations=iterations, q_mask=q_mask)
    out = dot_product_attention(centroids, x.k, x.v, kv_mask=kv_mask, scale=scale)
    return C.zero_masked_rows(out[cluster].astype(x.q.dtype), q_mask)


def improved_clustered_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *,
    num_clusters: int,
    topk: int,
    key,
    bits: int = 32,
    iterations: int = 10,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    q_mask: Bool[Array, "q_seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "q_seq v_dim"]:
    """Improved clustered attention for one sequence and one head.

    For a query in cluster ``c`` with centroid weights ``A_c [Lk]`` and top-k keys ``T_c``:
    ``out = m_c softmax(q K_T^T) V_T + sum_{j not in T_c} A_cj v_j``, ``m_c = sum_{T_c} A_cj``.
    Cost ``O(C Lk + Lq topk)``. With ``topk >= Lk`` it is exact softmax attention whatever the
    clustering. Arguments are those of :func:`clustered_attention`, plus ``topk``.
    """
    name = "improved_clustered_attention"
    x, kv_mask, q_mask = _checked(name, q, k, v, causal, kv_mask, q_mask, num_clusters, bits,
                                  iterations, key)
    topk = min(C.check_positive_int(name, "topk", topk), x.lk)
    cluster, centroids = cluster_queries(x.q, num_clusters, key=key, bits=bits,
                                         iterations=iterations, q_mask=q_mask)
    _, weights = dot_product_attention(centroids, x.k, x.k[:, :1], kv_mask=kv_mask,
                                       scale=scale, return_weights=True)
    top_w, top = jax.lax.top_k(weights, topk)
    mass = top_w.sum(-1)
    rest = weights.at[jnp.arange(num_clusters)[:, None], top].set(0.0)
    rest_out = jnp.einsum("ck,kd->cd", rest, x.v, preferred_element_type=C.STATS_DTYPE)
    real = jnp.ones((x.lk,), bool) if kv_mask is None else kv_mask

    def one(qi, c):
        idx = top[c]
        return dot_product_attention(qi[None], x.k[idx], x.v[idx], kv_mask=real[idx],
                                     scale=scale)[0]

    exact = jax.vmap(one)(x.q, cluster).astype(C.STATS_DTYPE)
    out = (mass[cluster][:, None] * exact + rest_out[cluster]).astype(x.q.dtype)
    return C.zero_masked_rows(out, q_mask)
