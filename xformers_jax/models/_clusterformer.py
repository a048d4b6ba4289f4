"""Cluster-Former (Wang et al., 2020, "Cluster-Former: Clustering-based Sparse Transformer for
Long-Range Dependency Encoding").

A Cluster-Former layer assigns every token to the nearest of ``K`` k-means centroids of the
layer's hidden states, sorts the tokens by (cluster, position), cuts the sorted sequence into
equal chunks and runs self-attention within each chunk; the outputs go back to their positions.
The centroids are not trained by gradients: the paper recomputes them by k-means over hidden
states periodically during training (:func:`kmeans_centroids`,
:meth:`ClusterformerAttention.with_centroids`).

How it relates to the registry's content-based kinds: it uses the same sort-and-chunk machinery
as Reformer's LSH and the Routing Transformer (``attention/learned/_sorted_chunks``), but it
is neither of them with other settings. LSH assigns buckets by random rotations; routing's
non-causal form lets each cluster take its top-``w`` nearest queries and keys (a token may be
in several clusters or none) and routes per head by q and k; Cluster-Former routes each token
once, by its hidden state (shared by the heads), with centroids from k-means, and a chunk
attends to itself only (not also to the previous chunk). Clustered attention (Vyas et al.)
clusters queries into prototypes, which is a low-rank approximation, not a sparsity pattern.

The layer is bidirectional (the paper's encoder for question answering); ``causal=True`` is
refused with a clear error. Padded tokens sort after every real one (their own cluster), so
the real tokens' chunks do not depend on the padding.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ..attention.learned._sorted_chunks import chunk_attention, permute, sort_by_code


def assign_clusters(h, centroids):
    """Nearest centroid (Euclidean) of each ``h [L, d]`` among ``centroids [K, d]``: int[L]."""
    h = jax.lax.stop_gradient(h).astype(jnp.float32)
    c = jax.lax.stop_gradient(centroids).astype(jnp.float32)
    d = jnp.sum(c * c, -1)[None] - 2 * h @ c.T
    return jnp.argmin(d, axis=-1).astype(jnp.int32)


def cluster_chunk_attention(q, k, v, clusters, num_clusters: int, *, chunk: int,
                            kv_mask=None, scale=None):
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


class ClusterformerAttention(eqx.Module):
    """A Cluster-Former attention layer over ``[B, L, dim]`` (module docstring).

    Args: dim, num_heads, num_clusters, chunk (tokens per chunk). ``centroids [K, dim]`` start
    random; refresh them with :meth:`with_centroids` (the paper's periodic k-means).
    """

    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    centroids: jax.Array
    num_heads: int = eqx.field(static=True)
    chunk: int = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, *, num_clusters: int = 4, chunk: int = 8,
                 causal: bool = False, key):
        if causal:
            raise ValueError("ClusterformerAttention: Cluster-Former is bidirectional; a "
                             "token's cluster chunk holds later tokens (causal=True is not "
                             "supported; the causal 'routing' kind is the causal relative)")
        if dim % num_heads:
            raise ValueError(f"ClusterformerAttention: dim={dim} is not divisible by "
                             f"num_heads={num_heads}")
        ks = jax.random.split(key, 5)
        self.wq, self.wk, self.wv, self.wo = (jax.random.normal(k, (dim, dim)) / math.sqrt(dim)
                                              for k in ks[:4])
        self.centroids = jax.random.normal(ks[4], (num_clusters, dim))
        self.num_heads, self.chunk = num_heads, chunk

    def with_centroids(self, h, *, mask=None, iterations: int = 10, key):
        """This layer with centroids from k-means over hidden states ``h [..., dim]``."""
        c = kmeans_centroids(h, self.centroids.shape[0], mask=mask, iterations=iterations,
                             key=key)
        return eqx.tree_at(lambda m: m.centroids, self, c.astype(self.centroids.dtype))

    def __call__(self, x, *, kv_mask=None, key=None):
        b, length, dim = x.shape
        nh = self.num_heads
        q, k, v = ((x @ w.astype(x.dtype)).reshape(b, length, nh, dim // nh)
                   for w in (self.wq, self.wk, self.wv))
        clusters = jax.vmap(lambda h: assign_clusters(h, self.centroids))(x)
        num = self.centroids.shape[0]

        def one(q, k, v, c, m):
            heads = jax.vmap(lambda a, bb, cc: cluster_chunk_attention(
                a, bb, cc, c, num, chunk=self.chunk, kv_mask=m), in_axes=1, out_axes=1)
            return heads(q, k, v)

        mask = jnp.ones((b, length), bool) if kv_mask is None else kv_mask
        o = jax.vmap(one)(q, k, v, clusters, mask)
        return o.reshape(b, length, dim) @ self.wo.astype(x.dtype)
