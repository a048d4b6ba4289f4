"""LSH, routing and Sinkhorn attention: content-based sorting into chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax.attention import (
    dot_product_attention, init_lsh_rotations, init_routing_state, init_sinkhorn_sort_net,
    lsh_attention, routing_attention, sinkhorn_attention,
)
from xformers_jax.attention.learned._lsh import lsh_buckets
from xformers_jax.attention.learned._routing import RoutingState, centroids
from xformers_jax.attention.learned._sinkhorn import (
    _greedy_assignment, gumbel_sinkhorn, hard_permutation, sinkhorn_sort_matrix,
)

L, D = 64, 16

# Jitted once per static configuration: op-by-op execution dominates these small tests.
lsh_attention = jax.jit(lsh_attention, static_argnames=("chunk_size", "causal"))
routing_attention = jax.jit(routing_attention, static_argnames=("window", "causal", "decay"))
sinkhorn_attention = jax.jit(sinkhorn_attention, static_argnames=(
    "block_size", "causal", "hard", "straight_through_top", "sortcut", "temperature",
    "iterations"))
sinkhorn_sort_matrix = jax.jit(sinkhorn_sort_matrix, static_argnames=(
    "block_size", "causal", "hard", "temperature", "iterations"))
dot_product_attention = jax.jit(dot_product_attention, static_argnames=("causal",))


def _qkv(key, length=L, dtype=jnp.float32):
    a, b, c = jax.random.split(key, 3)
    return tuple(jax.random.normal(x, (length, D), dtype) for x in (a, b, c))


def _unit(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _masked_reference(q, k, v, allowed):
    return dot_product_attention(q, k, v, bias=jnp.where(allowed, 0.0, -jnp.inf))


def _lsh_allowed(kn, rot, chunk, causal):
    """The union over rounds of the keys LSH lets each query see, in numpy."""
    b = np.asarray(lsh_buckets(kn, rot))
    n = kn.shape[0]
    allowed = np.zeros((n, n), bool)
    for r in range(b.shape[0]):
        order = np.lexsort((np.arange(n), b[r]))
        sidx = np.empty(n, int)
        sidx[order] = np.arange(n)
        same = b[r][:, None] == b[r][None, :]
        if causal:
            d = sidx[:, None] - sidx[None, :]
            allowed |= same & (d >= 0) & (d < chunk)
        else:
            c = sidx // chunk
            allowed |= same & ((c[None] == c[:, None]) | (c[None] == c[:, None] - 1))
    if causal:
        allowed &= np.tril(np.ones((n, n), bool))
    others = allowed & ~np.eye(n, dtype=bool)
    return np.where(others.any(1, keepdims=True), others, allowed)


# ----------------------------------------------------------------------------- LSH


def test_lsh_one_bucket_full_chunk_is_full_attention_without_self(key):
    q, _, v = _qkv(key)
    rot = init_lsh_rotations(key, D, num_buckets=1)
    out = lsh_attention(q, q, v, rot, chunk_size=L)
    ref = _masked_reference(q, _unit(q), v, ~np.eye(L, dtype=bool))
    assert_close(out, ref)


@pytest.mark.parametrize("causal", [False, True])
def test_lsh_rounds_combine_to_union_softmax(key, causal):
    q, _, v = _qkv(key)
    rot = init_lsh_rotations(jax.random.PRNGKey(3), D, num_buckets=4, num_rounds=3)
    out = lsh_attention(q, q, v, rot, chunk_size=8, causal=causal)
    allowed = _lsh_allowed(_unit(q), rot, 8, causal)
    assert allowed.sum(1).max() < L and allowed.sum(1).mean() < L / 2  # really sparse
    assert_close(out, _masked_reference(q, _unit(q), v, allowed))


def test_lsh_hashing_deterministic_per_key_and_different_across_keys():
    x = jax.random.normal(jax.random.PRNGKey(1), (L, D))
    r1 = init_lsh_rotations(jax.random.PRNGKey(5), D, 8, 2)
    r2 = init_lsh_rotations(jax.random.PRNGKey(5), D, 8, 2)
    r3 = init_lsh_rotations(jax.random.PRNGKey(6), D, 8, 2)
    np.testing.assert_array_equal(lsh_buckets(x, r1), lsh_buckets(x, r2))
    assert (np.asarray(lsh_buckets(x, r1)) != np.asarray(lsh_buckets(x, r3))).mean() > 0.3
    b = np.asarray(lsh_buckets(x, r1))
    assert b.min() >= 0 and b.max() < 8 and len(np.unique(b[0])) > 4
    # Angular: the hash ignores the norm.
    np.testing.assert_array_equal(lsh_buckets(3.0 * x, r1), b)


def test_lsh_causal_no_leak(key):
    q, _, v = _qkv(key)
    rot = init_lsh_rotations(jax.random.PRNGKey(3), D, 4, 2)
    f = lambda q, v: lsh_attention(q, q, v, rot, chunk_size=8, causal=True)
    t = 40
    q2 = q.at[t:].set(jax.random.normal(jax.random.PRNGKey(9), (L - t, D)))
    v2 = v.at[t:].add(5.0)
    # The same keys, possibly in other tile slots (the sort moved), so equal up to rounding.
    assert_close(f(q2, v2)[:t], f(q, v)[:t])
    gq, gv = jax.grad(lambda q, v: f(q, v)[:t].sum(), argnums=(0, 1))(q, v)
    assert np.all(np.asarray(gq[t:]) == 0) and np.all(np.asarray(gv[t:]) == 0)
    assert np.isfinite(gq).all() and np.abs(gq[:t]).max() > 0


def test_lsh_padding_invariance_and_finite_grads(key):
    q, _, v = _qkv(key)
    rot = init_lsh_rotations(jax.random.PRNGKey(3), D, 4, 2)
    mask = jnp.asarray(np.random.RandomState(0).rand(L) > 0.3)
    f = lambda q, v: lsh_attention(q, q, v, rot, chunk_size=8, kv_mask=mask)
    q2 = jnp.where(mask[:, None], q, 7.0)
    v2 = jnp.where(mask[:, None], v, -3.0)
    real = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(f(q, v))[real], np.asarray(f(q2, v2))[real])
    gv = jax.grad(lambda v: f(q, v)[real].sum())(v)
    assert np.all(np.asarray(gv)[~real] == 0)
    assert np.isfinite(f(q, v)).all() and np.isfinite(gv).all()


def test_lsh_gradients_match_masked_reference(key):
    q, _, v = _qkv(key)
    rot = init_lsh_rotations(jax.random.PRNGKey(3), D, 4, 2)
    allowed = _lsh_allowed(_unit(q), rot, 8, False)
    g = jax.grad(lambda q, v: (lsh_attention(q, q, v, rot, chunk_size=8) ** 2).sum(), (0, 1))(q, v)
    r = jax.grad(
        lambda q, v: (_masked_reference(q, _unit(q), v, allowed) ** 2).sum(), (0, 1))(q, v)
    for a, b in zip(g, r):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_lsh_bf16_jit_vmap(key):
    q, _, v = _qkv(key, dtype=jnp.bfloat16)
    rot = init_lsh_rotations(key, D, 4, 2)
    f = jax.jit(jax.vmap(lambda q, v: lsh_attention(q, q, v, rot, chunk_size=16)))
    out = f(q[None], v[None])[0]
    assert out.dtype == jnp.bfloat16
    ref = lsh_attention(q.astype(jnp.float32), q.astype(jnp.float32), v.astype(jnp.float32),
                        rot, chunk_size=16)
    assert_close(out, ref, dtype=jnp.bfloat16)


def test_lsh_errors(key):
    q, k, v = _qkv(key)
    rot = init_lsh_rotations(key, D, 4)
    with pytest.raises(ValueError, match="Lq must equal Lk"):
        lsh_attention(q[:10], k, v, rot)
    with pytest.raises(ValueError, match="rotations must have shape"):
        lsh_attention(q, k, v, rot[0])
    with pytest.raises(ValueError, match="num_buckets must be even"):
        init_lsh_rotations(key, D, 3)


# ----------------------------------------------------------------------------- routing


@pytest.mark.parametrize("causal", [False, True])
def test_routing_one_cluster_is_full_attention(key, causal):
    q, k, v = _qkv(key)
    state = init_routing_state(key, 1, D)
    out, aux = routing_attention(q, k, v, state, window=L, causal=causal)
    assert_close(out, dot_product_attention(q, k, v, causal=causal))
    assert np.isfinite(aux.commitment_loss)


def test_routing_centroid_update_matches_numpy_kmeans_step(key):
    q, k, v = _qkv(key)
    state = init_routing_state(jax.random.PRNGKey(2), 4, D)
    decay = 0.9
    _, aux = routing_attention(q, k, v, state, window=8, decay=decay)
    qn, kn = np.asarray(_unit(q)), np.asarray(_unit(k))
    mu = np.asarray(state.sums) / np.asarray(state.counts)[:, None]
    mu = mu / np.linalg.norm(mu, axis=1, keepdims=True)
    x = np.concatenate([qn, kn])
    assign = np.argmax(x @ mu.T, axis=1)
    sums = np.stack([x[assign == c].sum(0) for c in range(4)])
    counts = np.array([(assign == c).sum() for c in range(4)], np.float32)
    np.testing.assert_allclose(aux.state.sums, decay * np.asarray(state.sums) + (1 - decay) * sums,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux.state.counts,
                               decay * np.asarray(state.counts) + (1 - decay) * counts, rtol=1e-6)
    # decay = 0 is one plain (spherical) k-means step: the new centroids are cluster means.
    _, aux0 = routing_attention(q, k, v, state, window=8, decay=0.0)
    means = sums / np.maximum(counts, 1)[:, None]
    nonempty = counts > 0
    np.testing.assert_allclose(
        np.asarray(centroids(aux0.state))[nonempty],
        means[nonempty] / np.linalg.norm(means[nonempty], axis=1, keepdims=True), atol=1e-5)
    loss = np.mean(np.sum((x - mu[assign]) ** 2, 1))
    np.testing.assert_allclose(aux.commitment_loss, loss, rtol=1e-5)


def test_routing_balanced_clusters_reference(key):
    """Each query gets softmax over the union of the keys of the clusters that chose it."""
    q, k, v = _qkv(key)
    state = init_routing_state(jax.random.PRNGKey(2), 4, D)
    w = 16
    out, _ = routing_attention(q, k, v, state, window=w)
    mu = np.asarray(centroids(state))
    top_q = np.argsort(-(mu @ np.asarray(_unit(q)).T), axis=1, kind="stable")[:, :w]
    top_k = np.argsort(-(mu @ np.asarray(_unit(k)).T), axis=1, kind="stable")[:, :w]
    allowed = np.zeros((L, L), bool)
    for c in range(4):
        allowed[np.ix_(top_q[c], top_k[c])] = True
    ref = np.asarray(_masked_reference(q, k, v, allowed))
    chosen = allowed.any(1)
    assert chosen.sum() < L and chosen.sum() >= w
    assert_close(np.asarray(out)[chosen], ref[chosen])
    assert np.all(np.asarray(out)[~chosen] == 0)


def test_routing_causal_no_leak_and_padding(key):
    q, k, v = _qkv(key)
    state = init_routing_state(jax.random.PRNGKey(2), 4, D)
    mask = jnp.arange(L) < 50
    f = lambda q, k, v: routing_attention(q, k, v, state, window=8, causal=True, kv_mask=mask)[0]
    t = 30
    noise = jax.random.normal(jax.random.PRNGKey(4), (L - t, D))
    out = f(q, k, v)
    assert_close(f(q.at[t:].set(noise), k.at[t:].set(noise), v.at[t:].add(1))[:t], out[:t])
    grads = jax.grad(lambda q, k, v: f(q, k, v)[:t].sum(), (0, 1, 2))(q, k, v)
    for g in grads:
        assert np.all(np.asarray(g[t:]) == 0) and np.isfinite(g).all()
    # padding invariance (causal and balanced)
    for causal in (False, True):
        g = lambda k, v: routing_attention(q, k, v, state, window=8, causal=causal, kv_mask=mask)[0]
        np.testing.assert_array_equal(
            np.asarray(g(k, v))[:50], np.asarray(g(k.at[50:].set(9.0), v.at[50:].set(-9.0)))[:50])


def test_routing_errors(key):
    q, k, v = _qkv(key)
    state = init_routing_state(key, 4, D)
    with pytest.raises(ValueError, match="window=100 exceeds"):
        routing_attention(q, k, v, state, window=100)
    with pytest.raises(ValueError, match="state must hold sums"):
        routing_attention(q, k, v, RoutingState(state.sums[:, :3], state.counts), window=8)
    with pytest.raises(ValueError, match="causal routing needs Lq == Lk"):
        routing_attention(q[:10], k, v, state, window=8, causal=True)


# ----------------------------------------------------------------------------- Sinkhorn


def test_gumbel_sinkhorn_is_doubly_stochastic(key):
    logits = jax.random.normal(key, (8, 8))
    p = gumbel_sinkhorn(logits, temperature=1.0, iterations=50, key=jax.random.PRNGKey(1))
    np.testing.assert_allclose(p.sum(0), 1.0, atol=1e-4)
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-4)
    assert (np.asarray(p) >= 0).all()


def _sinkhorn_reference(q, k, v, perm, b, causal):
    """Local block + the explicitly permuted key block, per query block, in numpy."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    n, out = L // b, np.zeros((L, v.shape[1]))
    for i in range(n):
        qi = q[i * b:(i + 1) * b]
        keys, vals = [k[i * b:(i + 1) * b]], [v[i * b:(i + 1) * b]]
        bias = [np.where(np.tril(np.ones((b, b), bool)) | (not causal), 0.0, -np.inf)]
        if perm[i] >= 0:
            j = perm[i]
            keys.append(k[j * b:(j + 1) * b])
            vals.append(v[j * b:(j + 1) * b])
            bias.append(np.zeros((b, b)))
        s = qi @ np.concatenate(keys).T / np.sqrt(D) + np.concatenate(bias, 1)
        p = np.exp(s - s.max(1, keepdims=True))
        out[i * b:(i + 1) * b] = (p / p.sum(1, keepdims=True)) @ np.concatenate(vals)
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_sinkhorn_hard_sort_really_permutes_blocks(key, causal):
    q, k, v = _qkv(key)
    b = 8
    net = init_sinkhorn_sort_net(jax.random.PRNGKey(7), D, L // b)
    p = np.asarray(sinkhorn_sort_matrix(k, net, block_size=b, hard=True, causal=causal))
    assert set(np.unique(p)) <= {0.0, 1.0}
    if causal:
        assert (p.sum(1)[1:] == 1).all() and p[0].sum() == 0 and not np.triu(p).any()
        perm = np.where(p.sum(1) > 0, p.argmax(1), -1)
    else:
        np.testing.assert_array_equal(p.sum(0), 1)
        np.testing.assert_array_equal(p.sum(1), 1)
        perm = p.argmax(1)
        assert (perm != np.arange(L // b)).any()
    out = sinkhorn_attention(q, k, v, net, block_size=b, hard=True, causal=causal)
    assert_close(out, _sinkhorn_reference(q, k, v, perm, b, causal).astype(np.float32))


def test_sinkhorn_soft_sort_mixes_blocks_and_grads_reach_net(key):
    q, k, v = _qkv(key)
    net = init_sinkhorn_sort_net(jax.random.PRNGKey(7), D, 8)
    out = sinkhorn_attention(q, k, v, net, block_size=8, key=jax.random.PRNGKey(1))
    hard = sinkhorn_attention(q, k, v, net, block_size=8, hard=True, key=jax.random.PRNGKey(1))
    assert np.isfinite(out).all() and np.abs(out - hard).max() > 1e-3
    for h in (False, True):
        g = jax.grad(lambda n: sinkhorn_attention(q, k, v, n, block_size=8, hard=h,
                                                  key=jax.random.PRNGKey(1)).sum())(net)
        assert all(np.isfinite(a).all() for a in g) and np.abs(g.w2).max() > 0


@pytest.mark.parametrize("hard", [False, True])
def test_sinkhorn_causal_no_leak(key, hard):
    q, k, v = _qkv(key)
    net = init_sinkhorn_sort_net(jax.random.PRNGKey(7), D, 8)
    f = lambda k, v: sinkhorn_attention(q, k, v, net, block_size=8, causal=True, hard=hard)
    t = 37
    k2, v2 = k.at[t:].set(3.0), v.at[t:].set(-2.0)
    np.testing.assert_array_equal(f(k, v)[:t], f(k2, v2)[:t])
    gk, gv = jax.grad(lambda k, v: f(k, v)[:t].sum(), (0, 1))(k, v)
    assert np.all(np.asarray(gk[t:]) == 0) and np.all(np.asarray(gv[t:]) == 0)


@pytest.mark.parametrize("sortcut", [None, 2])
def test_sinkhorn_padding_invariance(key, sortcut):
    q, k, v = _qkv(key)
    net = init_sinkhorn_sort_net(jax.random.PRNGKey(7), D, 8)
    mask = jnp.asarray(np.random.RandomState(1).rand(L) > 0.25)
    f = lambda k, v: sinkhorn_attention(q, k, v, net, block_size=8, kv_mask=mask, sortcut=sortcut)
    k2 = jnp.where(mask[:, None], k, 5.0)
    v2 = jnp.where(mask[:, None], v, 5.0)
    np.testing.assert_allclose(f(k, v), f(k2, v2), atol=0, rtol=0)
    gk = jax.grad(lambda k: f(k, v).sum())(k)
    assert np.all(np.asarray(gk)[~np.asarray(mask)] == 0)


def test_sinkhorn_sortcut_reference(key):
    q, k, v = _qkv(key)
    net = init_sinkhorn_sort_net(jax.random.PRNGKey(7), D, 8)
    p = np.asarray(sinkhorn_sort_matrix(k, net, block_size=8, hard=True))
    out = sinkhorn_attention(q, k, v, net, block_size=8, hard=True, sortcut=2)
    first = p.argmax(1)[:2]
    allowed = np.zeros((L, L), bool)
    for j in first:
        allowed[:, j * 8:(j + 1) * 8] = True
    assert_close(out, _masked_reference(q, k, v, allowed))


def test_sinkhorn_bf16_and_errors(key):
    q, k, v = _qkv(key, dtype=jnp.bfloat16)
    net = init_sinkhorn_sort_net(key, D, 8)
    out = jax.jit(lambda q, k, v: sinkhorn_attention(q, k, v, net, block_size=8, hard=True))(q, k, v)
    ref = sinkhorn_attention(*(a.astype(jnp.float32) for a in (q, k, v)), net, block_size=8, hard=True)
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="gives 4 blocks"):
        sinkhorn_attention(q, k, v, net, block_size=16)
    with pytest.raises(NotImplementedError, match="sortcut"):
        sinkhorn_attention(q, k, v, net, block_size=8, causal=True, sortcut=2)
    with pytest.raises(ValueError, match="sortcut=9 exceeds"):
        sinkhorn_attention(q, k, v, net, block_size=8, sortcut=9)


def _greedy_reference(p):
    """The greedy permutation one entry at a time, as hard_permutation was first written."""
    p = np.array(p, np.float64)
    n = p.shape[0]
    idx = np.zeros(n, int)
    for _ in range(n):
        i, j = divmod(int(np.argmax(p)), n)
        idx[i] = j
        p[i, :] = -np.inf
        p[:, j] = -np.inf
    return idx


def test_hard_permutation_rounds_equal_one_at_a_time_greedy():
    rng = np.random.RandomState(0)
    greedy = jax.jit(_greedy_assignment)
    for n in (1, 2, 5, 16, 40):
        for p in (rng.rand(n, n), rng.randint(0, 3, (n, n)),  # many ties
                  np.zeros((n, n)), np.exp(4 * rng.randn(n, n))):
            p = p.astype(np.float32)
            np.testing.assert_array_equal(greedy(jnp.asarray(p)), _greedy_reference(p))
    p = jnp.asarray(rng.rand(16, 16), jnp.float32)
    np.testing.assert_array_equal(hard_permutation(p), np.eye(16)[_greedy_reference(p)])


def _sinkhorn_dense_sort(q, k, v, net, *, b, causal=False, kv_mask=None, hard=False, top=None,
                         sortcut=None):
    """sinkhorn_attention as first written: the sort applied as a dense [n, n] x [n, b, d]
    matmul of the (straight-through) sort matrix. ``top``: only the ``top`` largest entries
    of each row of the soft matrix carry the straight-through gradient."""
    kw = dict(block_size=b, causal=causal, kv_mask=kv_mask)
    p = sinkhorn_sort_matrix(k, net, **kw)
    if hard:
        one = jax.lax.stop_gradient(sinkhorn_sort_matrix(k, net, hard=True, **kw))
        if top is not None:
            keep = jax.lax.top_k(jax.lax.stop_gradient(p), top)[1]
            p = p * jax.lax.stop_gradient(jnp.zeros_like(p).at[
                jnp.arange(p.shape[0])[:, None], keep].set(1.0))
        p = one + (p - jax.lax.stop_gradient(p))
    n = p.shape[0]
    real = jnp.ones((L,), bool) if kv_mask is None else kv_mask
    real_b = real.reshape(n, b).astype(jnp.float32)
    qb, kb, vb = (jnp.where(real[:, None], a, 0.0).reshape(n, b, -1) for a in (q, k, v))
    sk, sv = (jnp.einsum("ij,jtd->itd", p, a) for a in (kb, vb))
    sw = p @ real_b
    s_bias = jnp.where(sw > 0, jnp.log(jnp.where(sw > 0, sw, 1.0)), -jnp.inf)
    if sortcut is not None:
        keys = jnp.broadcast_to(sk[:sortcut].reshape(1, -1, D), (n, sortcut * b, D))
        vals = jnp.broadcast_to(sv[:sortcut].reshape(1, -1, D), (n, sortcut * b, D))
        bias = jnp.broadcast_to(s_bias[:sortcut].reshape(1, 1, -1), (n, b, sortcut * b))
    else:
        ok = real_b[:, None, :] > 0
        if causal:
            ok = ok & np.tril(np.ones((b, b), bool))[None]
        keys, vals = jnp.concatenate([kb, sk], 1), jnp.concatenate([vb, sv], 1)
        bias = jnp.concatenate([jnp.broadcast_to(jnp.where(ok, 0.0, -jnp.inf), (n, b, b)),
                                jnp.broadcast_to(s_bias[:, None, :], (n, b, b))], 2)
    s = jnp.einsum("nqd,nkd->nqk", qb, keys) / np.sqrt(D) + bias
    return jnp.einsum("nqk,nkd->nqd", jax.nn.softmax(s, -1), vals).reshape(L, D)


@pytest.mark.parametrize("causal,masked,sortcut,hard,top", [
    (False, False, None, True, None), (False, False, None, True, 3),
    (False, True, None, True, 3), (False, True, 2, True, 3), (False, False, 2, True, None),
    (True, False, None, True, None), (True, True, None, True, 3), (False, True, 2, False, None),
])
def test_sinkhorn_gathered_sort_equals_dense_sort_matrix(key, causal, masked, sortcut, hard, top):
    """The gather (hard) and the sliced matmul (SortCut) compute the dense formula's output and
    gradients to q, k, v and the sort net; with straight_through_top the sort matrix's
    straight-through gradient is the dense one restricted to the top entries of each row."""
    q, k, v = _qkv(key)
    b = 8
    net = init_sinkhorn_sort_net(jax.random.PRNGKey(7), D, L // b)
    # Block 2 fully padded: a sorted block that is all padding gets a -inf bias.
    mask = (jnp.asarray(np.random.RandomState(1).rand(L) > 0.3).at[16:24].set(False)
            if masked else None)
    kw = dict(causal=causal, kv_mask=mask, hard=hard, sortcut=sortcut)
    new = lambda q, k, v, net: sinkhorn_attention(q, k, v, net, block_size=b,
                                                  straight_through_top=top, **kw)
    old = lambda q, k, v, net: _sinkhorn_dense_sort(q, k, v, net, b=b, top=top, **kw)
    w = jax.random.normal(jax.random.PRNGKey(4), (L, D))
    loss = lambda f: lambda *a: jnp.sum(f(*a) * w)
    assert_close(new(q, k, v, net), old(q, k, v, net))
    g_new = jax.grad(loss(new), argnums=(0, 1, 2, 3))(q, k, v, net)
    g_old = jax.grad(loss(old), argnums=(0, 1, 2, 3))(q, k, v, net)
    for a, e in zip(jax.tree_util.tree_leaves(g_new), jax.tree_util.tree_leaves(g_old)):
        assert np.isfinite(a).all()
        assert_close(a, e, table=EXACT_GRAD)
    assert np.abs(g_new[3].w2).max() > 0  # the straight-through gradient reaches the net


def test_sinkhorn_straight_through_top_truncates_only_the_net_path(key):
    """Fewer straight-through entries change the gradient only through the sort matrix: q's
    and v's gradients are the same, and with every entry (top >= num_blocks) it is exact."""
    q, k, v = _qkv(key)
    net = init_sinkhorn_sort_net(jax.random.PRNGKey(7), D, 8)
    grads = {top: jax.grad(lambda q, k, v, net: sinkhorn_attention(
        q, k, v, net, block_size=8, hard=True, straight_through_top=top).sum(),
        argnums=(0, 1, 2, 3))(q, k, v, net) for top in (None, 1, 8, 100)}
    for top in (1, 8, 100):
        np.testing.assert_array_equal(grads[top][0], grads[None][0])
        np.testing.assert_array_equal(grads[top][2], grads[None][2])
    for top in (8, 100):
        leaves = jax.tree_util.tree_leaves
        for a, e in zip(leaves(grads[top]), leaves(grads[None])):
            np.testing.assert_array_equal(a, e)
    assert np.abs(np.asarray(grads[1][3].w2) - np.asarray(grads[None][3].w2)).max() > 0


def test_sinkhorn_hard_gather_jit_vmap_grad(key):
    """The custom gradient composes with vmap (a batch of sequences) and jit."""
    qs, ks, vs = (jax.random.normal(x, (3, L, D)) for x in jax.random.split(key, 3))
    net = init_sinkhorn_sort_net(jax.random.PRNGKey(7), D, 8)
    f = lambda q, k, v: sinkhorn_attention(q, k, v, net, block_size=8, hard=True,
                                           straight_through_top=3).sum()
    gb = jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1, 2))))(qs, ks, vs)
    for i in range(3):
        gi = jax.grad(f, argnums=(0, 1, 2))(qs[i], ks[i], vs[i])
        for a, e in zip(gb, gi):
            assert_close(a[i], e, table=EXACT_GRAD)


def test_sinkhorn_hard_gather_bf16_grads(key):
    q, k, v = _qkv(key, dtype=jnp.bfloat16)
    net = init_sinkhorn_sort_net(jax.random.PRNGKey(7), D, 8)
    for causal in (False, True):
        g = jax.grad(lambda q, k, v: sinkhorn_attention(
            q, k, v, net, block_size=8, hard=True, straight_through_top=3, causal=causal
        ).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)
        g32 = jax.grad(lambda q, k, v: sinkhorn_attention(
            q, k, v, net, block_size=8, hard=True, straight_through_top=3, causal=causal
        ).sum(), argnums=(0, 1, 2))(*(a.astype(jnp.float32) for a in (q, k, v)))
        assert all(a.dtype == jnp.bfloat16 and np.isfinite(a.astype(np.float32)).all() for a in g)
        assert_close(g[2], g32[2], table=EXACT_GRAD, dtype=jnp.bfloat16)  # v: through the gather


@pytest.mark.parametrize("causal,masked,sortcut,hard", [
    (False, False, None, False), (False, True, None, True), (True, True, None, True),
    (True, False, None, False), (False, True, 3, False), (False, False, 3, True),
])
def test_sinkhorn_block_groups_equal_all_at_once(key, monkeypatch, causal, masked, sortcut, hard):
    """On CPU the query blocks go in groups (recomputed in the backward): the same outputs
    and gradients as all blocks at once, with a last group that is not full (22 blocks of 3,
    the last one padded, in groups of 4)."""
    from xformers_jax.attention.learned import _sinkhorn as S

    q, k, v = _qkv(key)
    b, n = 3, 22
    net = init_sinkhorn_sort_net(jax.random.PRNGKey(7), D, n)
    mask = jnp.asarray(np.random.RandomState(2).rand(L) > 0.3) if masked else None
    w = jax.random.normal(jax.random.PRNGKey(4), (L, D))

    def run(group):
        monkeypatch.setattr(S, "_CPU_GROUP_BLOCKS", group)
        monkeypatch.setattr(S, "_CPU_GROUP_ABOVE_BYTES", 0)  # group even these tiny blocks
        assert S._block_group(n, b, 2 * b if sortcut is None else sortcut * b) == group
        # A fresh function per setting, so jit traces again under it.
        f = jax.jit(lambda q, k, v, net: S.sinkhorn_attention(
            q, k, v, net, block_size=b, causal=causal, kv_mask=mask, sortcut=sortcut, hard=hard,
            straight_through_top=5 if hard else None))
        out = f(q, k, v, net)
        grads = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2, 3))(q, k, v, net)
        return out, jax.tree_util.tree_leaves(grads)

    (out, grads), (ref, ref_grads) = run(4), run(None)
    assert_close(out, ref)
    for a, e in zip(grads, ref_grads):
        assert np.isfinite(a).all()
        assert_close(a, e, table=EXACT_GRAD)


def test_sinkhorn_straight_through_top_errors(key):
    q, k, v = _qkv(key)
    net = init_sinkhorn_sort_net(key, D, 8)
    with pytest.raises(ValueError, match="hard=True"):
        sinkhorn_attention(q, k, v, net, block_size=8, straight_through_top=2)
    with pytest.raises(ValueError, match="straight_through_top"):
        sinkhorn_attention(q, k, v, net, block_size=8, hard=True, straight_through_top=0)
