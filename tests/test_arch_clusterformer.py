"""Cluster-Former: attention within chunks of the (cluster, position)-sorted sequence against a
dense numpy reference; the layer's routing by hidden states, padding invariance, gradients;
k-means centroids against Lloyd's algorithm in numpy; the causal error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xformers_jax.attention import cluster_chunk_attention
from xformers_jax.models import ClusterformerAttention
from tests.fast_jit import build, jit0
from tests.tolerances import assert_close

L, DK, CHUNK, K = 13, 8, 4, 3


def _ref(q, k, v, clusters, n_real):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    order = sorted(range(n_real), key=lambda i: (int(clusters[i]), i))
    out = np.zeros((q.shape[0], v.shape[1]))
    for c0 in range(0, n_real, CHUNK):
        members = order[c0:c0 + CHUNK]
        for i in members:
            s = np.array([q[i] @ k[j] for j in members]) / np.sqrt(DK)
            p = np.exp(s - s.max())
            out[i] = (p / p.sum()) @ v[members]
    return out


def test_chunk_attention_matches_reference_with_padding():
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k = jax.random.normal(ks[0], (L, DK)), jax.random.normal(ks[1], (L, DK))
    v = jax.random.normal(ks[2], (L, DK))
    clusters = jax.random.randint(ks[3], (L,), 0, K)
    f = jit0(lambda q, k, v, c, m: cluster_chunk_attention(q, k, v, c, K, chunk=CHUNK,
                                                               kv_mask=m))
    assert_close(f(q, k, v, clusters, None), _ref(q, k, v, clusters, L))
    n = L - 3
    mask = jnp.arange(L) < n
    out = f(q, k, v.at[n:].set(9.0), clusters.at[n:].set(0), mask)
    assert_close(out[:n], _ref(q, k, v, clusters, n)[:n])
    assert float(jnp.abs(out[n:]).max()) == 0.0


def test_layer_routing_padding_gradients_kmeans():
    layer = build(lambda key: ClusterformerAttention(16, 2, num_clusters=K, chunk=CHUNK, key=key),
                  1)
    x = jax.random.normal(jax.random.PRNGKey(2), (2, L, 16))
    layer = jit0(lambda m, x: m.with_centroids(x, key=jax.random.PRNGKey(3)))(layer, x)
    run = jit0(lambda m, x, mask: m(x, kv_mask=mask))
    y = run(layer, x, None)
    # Each head is cluster_chunk_attention with the clusters of the hidden states.
    c = np.argmin(((np.asarray(x[0])[:, None] - np.asarray(layer.centroids)[None]) ** 2).sum(-1),
                  1)
    q, k, v = (np.asarray(x[0]) @ np.asarray(w) for w in (layer.wq, layer.wk, layer.wv))
    heads = [_ref(q[:, h * 8:(h + 1) * 8], k[:, h * 8:(h + 1) * 8], v[:, h * 8:(h + 1) * 8],
                  np.asarray(c), L) for h in range(2)]
    assert_close(y[0], np.concatenate(heads, -1) @ np.asarray(layer.wo))
    n = L - 4
    mask = jnp.broadcast_to(jnp.arange(L) < n, (2, L))
    padded = run(layer, x.at[:, n:].set(3.0), mask)
    assert_close(padded[:, :n], run(layer, x[:, :n], None))
    g = jit0(jax.grad(lambda m: jnp.sum(jnp.sin(m(x)))))(layer)
    assert float(jnp.abs(g.wq).max()) > 0 and float(jnp.abs(g.centroids).max()) == 0.0
    # Lloyd's algorithm in numpy from the same start.
    pts = np.asarray(x.reshape(-1, 16), np.float64)
    draw = np.asarray(jax.random.uniform(jax.random.PRNGKey(3), (pts.shape[0],)))
    cent = pts[np.argsort(-draw, kind="stable")[:K]]
    for _ in range(10):
        a = np.argmin(((pts[:, None] - cent[None]) ** 2).sum(-1), 1)
        cent = np.stack([pts[a == j].mean(0) if (a == j).any() else cent[j] for j in range(K)])
    assert_close(layer.centroids, cent)
    with pytest.raises(ValueError, match="bidirectional"):
        ClusterformerAttention(16, 2, causal=True, key=jax.random.PRNGKey(0))
