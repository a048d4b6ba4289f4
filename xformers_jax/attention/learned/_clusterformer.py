"""Cluster-Former's attention (Wang et al., 2020, "Cluster-Former: Clustering-based Sparse
Transformer for Long-Range Dependency Encoding") as functions: tokens assigned to the nearest
k-means centroid of their hidden states, sorted by (cluster, position), cut into equal chunks,
attention within each chunk (:func:`cluster_chunk_attention`), on the same sort-and-chunk
machinery as Reformer's LSH and the Routing Transformer (``_sorted_chunks``); the centroids
come from k-means (:func:`kmeans_centroids`). The layer is ``models.ClusterformerAttention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._sorted_chunks import chunk_attention, permute, sort_by_code


def assign_clusters(h, centroids):
    """Nearest centroid (Euclidean) of each ``h [L, d]`` among ``centroids [K, d]``: int[L]."""
    h = jax.lax.stop_gradient(h).astype(jnp.float32)
    c = jax.lax.stop_gradient(centroids).astype(jnp.float32)
    d = jnp.sum(c * c, -1)[None] - 2 * h @ c.T
    return jnp.argmin(d, axis=-1).astype(jnp.int32)


def cluster_chunk_attention(
    q: Float[Array, "seq qk_dim"],
    k: Float[Array, "seq qk_dim"],
    v: Float[Array, "seq v_dim"],
    clusters: Int[Array, "seq"],
    num_clusters: int,
    *,
    chunk: int,
    kv_mask: Bool[Array, "seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq v_dim"]:
    """One head of one sequence: attention within chunks of the sequence sorted by
    ``(clusters, position)``.

    Args:
      q, k: ``[L, Dk]``. v: ``[L, Dv]``. clusters: ``int[L]`` in ``[0, num_clusters)``.
      chunk: tokens per chunk. kv_mask: ``bool[L]`` (padded tokens sort last and are never
      attended to). scale: ``1/sqrt(Dk)`` by default.

    Returns:
      ``[L, Dv]``, zero at padded positions.
    """
    length = q.shape[0]
    if k.shape[0] != length or v.shape[0] != length or clusters.shape != (length,):
        raise ValueError(f"cluster_chunk_attention: q, k, v and clusters need one length; got "
                         f"q{q.shape}, k{k.shape}, v{v.shape}, clusters{clusters.shape}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    padded = -(-length // chunk) * chunk
    real = jnp.ones((length,), bool) if kv_mask is None else kv_mask
    real = jnp.pad(real, (0, padded - length))
    code = jnp.where(real, jnp.pad(clusters, (0, padded - length)), num_clusters)
    perm, inverse = sort_by_code(code * padded + jnp.arange(padded, dtype=jnp.int32))

    def pad(a):
        return jnp.pad(a, ((0, padded - length), (0, 0)))

    key_real = real[perm].reshape(-1, 1, chunk)
    own = jnp.concatenate([jnp.zeros_like(key_real), key_real], -1)   # no previous chunk

    def score_fn(s):
        return jnp.where(own, s, -jnp.inf)

    out, _ = chunk_attention(permute(pad(q), perm, inverse), permute(pad(k), perm, inverse),
                             permute(pad(v), perm, inverse), score_fn, chunk=chunk, scale=scale)
    out = permute(out, inverse, perm)[:length]
    return jnp.where(real[:length, None], out, 0.0).astype(v.dtype)


def kmeans_centroids(h, num_clusters: int, *, mask=None, iterations: int = 10, key):
    """Lloyd's k-means on hidden states ``h [..., d]`` (real rows per ``mask``): ``[K, d]``.
    Starts from ``K`` distinct real rows drawn with ``key``; an empty cluster keeps its centre."""
    x = h.reshape(-1, h.shape[-1]).astype(jnp.float32)
    real = jnp.ones((x.shape[0],), bool) if mask is None else mask.reshape(-1)
    draw = jax.random.uniform(key, (x.shape[0],))
    start = jax.lax.top_k(jnp.where(real, draw, -1.0), num_clusters)[1]
    c = x[start]
    for _ in range(iterations):
        a = jax.nn.one_hot(assign_clusters(x, c), num_clusters) * real[:, None]
        n = a.sum(0)
        c = jnp.where(n[:, None] > 0, (a.T @ x) / jnp.maximum(n, 1)[:, None], c)
    return c
