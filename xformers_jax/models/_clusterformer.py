"""Cluster-Former (Wang et al., 2020, "Cluster-Former: Clustering-based Sparse Transformer for
Long-Range Dependency Encoding").

A Cluster-Former layer assigns every token to the nearest of ``K`` k-means centroids of the
layer's hidden states, sorts the tokens by (cluster, position), cuts the sorted sequence into
equal chunks and runs self-attention within each chunk; the outputs go back to their positions.
The centroids are not trained by gradients: the paper recomputes them by k-means over hidden
states periodically during training (``attention.kmeans_centroids``,
:meth:`ClusterformerAttention.with_centroids`).

How it relates to the registry's content-based kinds: it uses the same sort-and-chunk machinery
as Reformer's LSH and the Routing Transformer (``attention.cluster_chunk_attention``), but it
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

from .. import axes as X
from ..attention import assign_clusters, cluster_chunk_attention, kmeans_centroids


class ClusterformerAttention(eqx.Module):
    """A Cluster-Former attention layer over ``[B, L, dim]`` (module docstring).

    Args: dim, num_heads, num_clusters, chunk (tokens per chunk). ``centroids [K, dim]`` start
    random; refresh them with :meth:`with_centroids` (the paper's periodic k-means).
    """

    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    # Not trained by gradients (k-means refreshes them): a fixed buffer for the optimizer.
    centroid_buffer: X.Buffer
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
        self.centroid_buffer = X.Buffer(jax.random.normal(ks[4], (num_clusters, dim)))
        self.num_heads, self.chunk = num_heads, chunk

    def with_centroids(self, h, *, mask=None, iterations: int = 10, key):
        """This layer with centroids from k-means over hidden states ``h [..., dim]``."""
        c = kmeans_centroids(h, self.centroids.shape[0], mask=mask, iterations=iterations,
                             key=key)
        return eqx.tree_at(lambda m: m.centroid_buffer.value, self,
                           c.astype(self.centroids.dtype))

    @property
    def centroids(self) -> jax.Array:
        """``[K, dim]``: the k-means centroids (a fixed buffer: no optimizer touches them)."""
        return self.centroid_buffer.value

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
