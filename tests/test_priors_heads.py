"""Multi-head variants (talking heads, collaborative heads, multi-scale heads, disagreement)
and priors from the layer below (Realformer, Predictive attention, Lazyformer) against
references written from the papers' equations: outputs and gradients, the tiled forms against
the dense ones, reductions to vanilla attention, causal no-leak, padding, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xformers_jax.attention as A
from tests.test_priors import compare, jit0
from tests.tolerances import EXACT, assert_close

L, D = 12, 8


def _normal(seed, *shape):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def _vis(lq, lk, causal, mask):
    vis = np.ones((lq, lk), bool)
    if causal:
        vis &= np.arange(lk)[None] <= np.arange(lq)[:, None]
    if mask is not None:
        vis &= np.asarray(mask)[None]
    return vis


def _softmax(s, vis):
    s = jnp.where(vis, s, -1e30)
    w = jnp.exp(s - s.max(-1, keepdims=True)) * vis
    return w / jnp.maximum(w.sum(-1, keepdims=True), 1e-30)


def _vanilla(q, k, v, causal=False, mask=None):
    """Vanilla multi-head attention, q, k, v ``[L, H, D]``."""
    return jax.vmap(lambda a, b, c: A.dot_product_attention(a, b, c, causal=causal,
                                                            kv_mask=mask),
                    in_axes=1, out_axes=1)(q, k, v)


# --- talking heads (Shazeer et al., 2020) -----------------------------------------------------

def _talking_ref(q, k, v, p_l, p_w, causal, mask):
    hk, h = p_l.shape
    j = jnp.stack([q[:, a] @ k[:, a].T / np.sqrt(q.shape[-1]) for a in range(hk)])  # [Hk,L,L]
    mixed = jnp.einsum("aqk,ab->bqk", j, p_l)                    # the logits projection
    w = _softmax(mixed, _vis(q.shape[0], k.shape[0], causal, mask))
    w2 = jnp.einsum("bqk,bc->cqk", w, p_w)                       # the weights projection
    return jnp.stack([w2[c] @ v[:, c] for c in range(p_w.shape[1])], axis=1)


TALK = functools.partial(A.talking_heads_attention, block_q=4, block_k=4)


@pytest.mark.parametrize("implementation,causal", [("tiled", True), ("dense", False)])
def test_talking_heads_matches_paper_outputs_and_gradients(implementation, causal):
    # Hk = 2 query/key heads, H = 3 softmax heads, Hv = 2 value heads.
    q, k, v = _normal(0, L, 2, D), _normal(1, L, 2, D), _normal(2, L, 2, D)
    p_l, p_w = _normal(3, 2, 3), _normal(4, 3, 2)
    mask = np.arange(L) < L - 3
    f = lambda *a: TALK(*a, causal=causal, kv_mask=mask,  # noqa: E731
                        implementation=implementation)
    compare(f, lambda *a: _talking_ref(*a, causal, mask), (q, k, v, p_l, p_w))


def test_talking_heads_identity_mixing_is_vanilla_and_causal_no_leak():
    q, k, v = _normal(5, L, 3, D), _normal(6, L, 3, D), _normal(7, L, 3, D)
    eye = jnp.eye(3)
    run = jit0(lambda q, k, v, m: TALK(q, k, v, m, m.T, causal=True))
    assert_close(run(q, k, v, eye), _vanilla(q, k, v, causal=True))
    mix = _normal(8, 3, 3)
    base, t = run(q, k, v, mix), L // 2
    moved = run(q.at[t].add(1.0), k.at[t].add(1.0), v.at[t].add(1.0), mix)
    np.testing.assert_array_equal(np.asarray(moved[:t]), np.asarray(base[:t]))
    assert float(jnp.abs(moved[t:] - base[t:]).max()) > 1e-3


def test_talking_heads_errors():
    q = jnp.zeros((L, 2, D))
    with pytest.raises(ValueError, match=r"logits_mix must be \[Hk, H\]"):
        A.talking_heads_attention(q, q, q, jnp.eye(3), jnp.eye(3))
    with pytest.raises(ValueError, match="implementation must be one of"):
        A.talking_heads_attention(q, q, q, jnp.eye(2), jnp.eye(2), implementation="fast")
    with pytest.raises(ValueError, match=r"\[length, heads, dim\]"):
        A.talking_heads_attention(q[0], q[0], q[0], jnp.eye(2), jnp.eye(2))


# --- collaborative heads (Cordonnier et al., 2020) --------------------------------------------

def _collab_ref(q, k, v, m, causal, mask):
    h = m.shape[0]
    scale = (q.shape[-1] / h) ** -0.5
    out = [_softmax((q * m[i]) @ k.T * scale, _vis(q.shape[0], k.shape[0], causal, mask))
           @ v[:, i] for i in range(h)]                           # eq. 6, one head at a time
    return jnp.stack(out, axis=1)


@pytest.mark.parametrize("causal", [True])
def test_collaborative_matches_paper_and_converted_vanilla_layer(causal):
    q, k, v, m = _normal(9, L, 12), _normal(10, L, 12), _normal(11, L, 3, D), _normal(12, 3, 12)
    mask = np.arange(L) != 5
    f = lambda *a: A.collaborative_attention(*a, causal=causal, kv_mask=mask,  # noqa: E731
                                             block_q=4, block_k=4)
    compare(f, lambda *a: _collab_ref(*a, causal, mask), (q, k, v, m))
    # One collaborative head per head: the converted layer is vanilla multi-head attention.
    indicator = A.collaborative_mixing_from_heads(3, 4)
    out = jit0(f)(q, k, v, indicator)
    assert_close(out, _vanilla(q.reshape(L, 3, 4), k.reshape(L, 3, 4), v, causal, mask))


def test_collaborative_errors():
    with pytest.raises(ValueError, match=r"mixing must be \[H, Dq\] = \[3, 12\]"):
        A.collaborative_attention(jnp.zeros((L, 12)), jnp.zeros((L, 12)), jnp.zeros((L, 3, D)),
                                  jnp.zeros((2, 12)))


# --- multi-scale heads (Guo et al., 2020) -----------------------------------------------------

@pytest.mark.parametrize("causal", [True])
def test_multiscale_heads_match_banded_reference(causal):
    q, k, v = _normal(13, L, 3, D), _normal(14, L, 3, D), _normal(15, L, 3, D)
    spans, mask = (1, 3, None), np.arange(L) < L - 2

    def ref(q, k, v):
        out = []
        for h, w in enumerate(spans):
            vis = _vis(L, L, causal, mask)
            if w is not None:
                d = np.arange(L)[None] - np.arange(L)[:, None]
                vis &= np.abs(d) <= w
            out.append(_softmax(q[:, h] @ k[:, h].T / np.sqrt(D), vis) @ v[:, h])
        return jnp.stack(out, axis=1)

    f = lambda q, k, v: A.multiscale_attention(q, k, v, spans=spans, causal=causal,  # noqa
                                               kv_mask=mask, block_q=4, block_k=4)
    out = compare(f, ref, (q, k, v))
    # The head without a span is vanilla attention.
    assert_close(out[:, 2], _vanilla(q, k, v, causal, mask)[:, 2])
    with pytest.raises(ValueError, match="one span per head"):
        A.multiscale_attention(q, k, v, spans=(1, 2))


# --- disagreement regularisation (Li et al., 2018) --------------------------------------------

def test_disagreement_terms_match_paper():
    v, o = np.asarray(_normal(16, L, 3, D)), np.asarray(_normal(17, L, 3, D))
    w = np.asarray(jax.nn.softmax(_normal(18, 3, L, L), -1))
    mask = np.arange(L) < L - 2
    got = A.disagreement(v, w, o, mask=mask)

    def cos_term(x):
        tot = 0.0
        for pos in np.flatnonzero(mask):
            for i in range(3):
                for j in range(3):
                    a, b = x[pos, i], x[pos, j]
                    tot += a @ b / np.linalg.norm(a) / np.linalg.norm(b)
        return -tot / 9 / mask.sum()

    pos_term = -sum((w[i][p] * w[j][p]).sum() for p in np.flatnonzero(mask)
                    for i in range(3) for j in range(3)) / 9 / mask.sum()
    np.testing.assert_allclose([got.subspace, got.position, got.output],
                               [cos_term(v), pos_term, cos_term(o)], rtol=1e-5)
    same = A.disagreement(np.repeat(v[:, :1], 3, 1), w, o)
    np.testing.assert_allclose(same.subspace, -1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="one H"):
        A.disagreement(v, w[:2], o)


# --- Realformer (He et al., 2021) -------------------------------------------------------------

@pytest.mark.parametrize("causal", [True])
def test_realformer_tiled_equals_dense_chain_outputs_and_gradients(causal):
    n = 3
    qs, ks, vs = _normal(19, n, L, D), _normal(20, n, L, D), _normal(21, n, L, D)
    mask = np.arange(L) < L - 3

    def chain(qs, ks, vs):                       # S_l = q_l k_l^T / sqrt(d) + S_{l-1}
        s = None
        for layer in range(n):
            out, s = A.realformer_attention(qs[layer], ks[layer], vs[layer], s, causal=causal,
                                            kv_mask=mask)
        return out

    def paper(qs, ks, vs):
        s = sum(qs[m] @ ks[m].T / np.sqrt(D) for m in range(n))
        return _softmax(s, _vis(L, L, causal, mask)) @ vs[-1]

    tiled = lambda qs, ks, vs: A.realformer_flash_attention(  # noqa: E731
        qs, ks, vs[-1], causal=causal, kv_mask=mask, block_q=4, block_k=4)
    compare(tiled, paper, (qs, ks, vs))
    assert_close(chain(qs, ks, vs), paper(qs, ks, vs))
    # One layer is vanilla attention.
    assert_close(A.realformer_attention(qs[0], ks[0], vs[0], causal=causal, kv_mask=mask)[0],
                 A.dot_product_attention(qs[0], ks[0], vs[0], causal=causal, kv_mask=mask))


def test_realformer_errors():
    with pytest.raises(ValueError, match=r"qs \[n, Lq, Dk\] and ks \[n, Lk, Dk\]"):
        A.realformer_flash_attention(jnp.zeros((2, L, D)), jnp.zeros((3, L, D)),
                                     jnp.zeros((L, D)))
    with pytest.raises(ValueError, match=r"prev_scores must be \[Lq, Lk\]"):
        A.realformer_attention(jnp.zeros((L, D)), jnp.zeros((L, D)), jnp.zeros((L, D)),
                               jnp.zeros((L, 3)))


# --- Predictive attention (Wang et al., 2021) and Lazyformer (Ying et al., 2021) --------------

def _conv_ref(prev, conv, causal, mask):
    """Explicit 3 x 3 convolution with zero padding, heads as channels."""
    h = prev.shape[0]
    vis = _vis(L, L, causal, mask) & (np.ones(L, bool) if mask is None else mask)[:, None]
    p = np.where(vis, np.asarray(prev), 0.0)
    out = np.zeros_like(p)
    rows = (-2, -1, 0) if causal else (-1, 0, 1)
    for o in range(h):
        for i in range(h):
            for a, di in enumerate(rows):
                for b, dj in enumerate((-1, 0, 1)):
                    shifted = np.zeros_like(p[i])
                    src = p[i][max(di, 0):L + min(di, 0), max(dj, 0):L + min(dj, 0)]
                    shifted[max(-di, 0):L + min(-di, 0), max(-dj, 0):L + min(-dj, 0)] = src
                    out[o] += conv[o, i, a, b] * shifted
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_predictive_attention_matches_paper_and_reduces_to_vanilla(causal):
    q, k, v = _normal(22, L, 2, D), _normal(23, L, 2, D), _normal(24, L, 2, D)
    prev, conv = _normal(25, 2, L, L), np.asarray(_normal(26, 2, 2, 3, 3))
    mask, alpha = np.arange(L) < L - 2, 0.6
    out, s = A.predictive_attention(q, k, v, prev, conv, alpha, causal=causal, kv_mask=mask)
    own = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(D)
    want_s = alpha * own + (1 - alpha) * _conv_ref(prev, conv, causal, mask)
    w = _softmax(want_s, _vis(L, L, causal, mask)[None])
    assert_close(out, jnp.einsum("hqk,khd->qhd", w, v))
    # alpha = 1 and the first layer (no previous map) are vanilla attention.
    van = _vanilla(q, k, v, causal, mask)
    assert_close(A.predictive_attention(q, k, v, prev, conv, 1.0, causal=causal,
                                        kv_mask=mask)[0], van)
    assert_close(A.predictive_attention(q, k, v, None, conv, alpha, causal=causal,
                                        kv_mask=mask)[0], van)
    g = jax.grad(lambda c: jnp.sum(A.predictive_attention(q, k, v, prev, c, alpha,
                                                          causal=causal)[0]))(conv)
    assert float(jnp.abs(g).sum()) > 0


def test_predictive_attention_two_layers_leak_nothing_from_a_middle_token():
    conv = np.asarray(_normal(27, 2, 2, 3, 3))
    x = _normal(28, L, 2, D)

    def two_layers(x):
        o, s = A.predictive_attention(x, x, x, None, conv, 0.5, causal=True)
        return A.predictive_attention(o, o, o, s, conv, 0.5, causal=True)[0]

    t = L // 2
    base, moved = two_layers(x), two_layers(x.at[t].add(1.0))
    np.testing.assert_allclose(np.asarray(moved[:t]), np.asarray(base[:t]), atol=1e-6)
    assert float(jnp.abs(moved[t:] - base[t:]).max()) > 1e-3


@pytest.mark.parametrize("every", [1, 2])
def test_lazyformer_reuses_maps_every_k_layers(every):
    n = 4
    qs, ks, vs = _normal(29, n, L, D), _normal(30, n, L, D), _normal(31, n, L, D)
    w, outs = None, []
    for layer in range(n):
        o, w = A.lazy_attention(qs[layer], ks[layer], vs[layer], w,
                                recompute=layer % every == 0, causal=True)
        outs.append(o)
    for layer in range(n):
        src = layer - layer % every               # the layer whose map this one uses
        ref = A.attention_weights(qs[src], ks[src], causal=True)[0] @ vs[layer]
        assert_close(outs[layer], ref)
        if every == 1:                             # k = 1 is vanilla attention
            assert_close(outs[layer], A.dot_product_attention(qs[layer], ks[layer], vs[layer],
                                                              causal=True))
    with pytest.raises(ValueError, match="needs prev_weights"):
        A.lazy_attention(qs[0], ks[0], vs[0], None, recompute=False)


def test_talking_heads_bf16():
    q, k, v = (_normal(s, L, 2, D) for s in (32, 33, 34))
    eye = jnp.eye(2) + 0.1
    out = jit0(lambda q, k, v: TALK(q, k, v, eye, eye, causal=True))(
        *(x.astype(jnp.bfloat16) for x in (q, k, v)))
    assert out.dtype == jnp.bfloat16
    assert_close(out, _talking_ref(q, k, v, eye, eye, True, None), EXACT, dtype=jnp.bfloat16)


# --- routing-by-agreement aggregation (Li et al., 2019) ---------------------------------------

def test_routing_aggregation_matches_dynamic_routing_loop():
    heads = np.asarray(_normal(35, 3, 4, 5))                       # L=3, H=4, D=5
    w = np.asarray(A.init_routing_votes(jax.random.PRNGKey(36), 4, 5, 2, 3))
    got = A.routing_aggregation(heads, w, iterations=3)

    def squash(s):
        n2 = (s * s).sum()
        return s * n2 / (1 + n2) / np.sqrt(n2 + 1e-12)

    want = []
    for pos in range(3):
        v_hat = np.einsum("hd,hnde->hne", heads[pos], w)
        b = np.zeros((4, 2))
        for it in range(3):
            c = np.exp(b) / np.exp(b).sum(1, keepdims=True)
            v = np.stack([squash((c[:, n, None] * v_hat[:, n]).sum(0)) for n in range(2)])
            b = b + np.einsum("hne,ne->hn", v_hat, v)
        want.append(v.reshape(-1))
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-6)
    # One round: each head couples uniformly to the N = 2 outputs (softmax over outputs).
    one = A.routing_aggregation(heads, w, iterations=1)
    mean = np.einsum("lhd,hnde->lne", heads, w) / 2
    np.testing.assert_allclose(one, np.stack([np.concatenate([squash(m) for m in row])
                                              for row in mean]), rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda w: jnp.sum(A.routing_aggregation(heads, w) ** 2))(w)
    assert bool(jnp.isfinite(g).all()) and float(jnp.abs(g).sum()) > 0
    with pytest.raises(ValueError, match="same H and D"):
        A.routing_aggregation(heads, w[:2])
