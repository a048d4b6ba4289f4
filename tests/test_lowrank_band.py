"""Low-rank attention with a band branch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax.attention import (
    dot_product_attention,
    init_lowrank_band,
    lowrank_band_attention,
)
from xformers_jax.attention.patterns import Local

L, D, R, W = 40, 16, 4, 3
WQ, WK, GATE = init_lowrank_band(jax.random.PRNGKey(1), D, R, gate=0.4)
lrb = jax.jit(lowrank_band_attention, static_argnames=("window", "causal"))


def _qkv(seed=0, lq=L):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(ks[0], (lq, D)), jax.random.normal(ks[1], (L, D)),
            jax.random.normal(ks[2], (L, D)))


def _reference(q, k, v, wq, wk, gate, causal, mask, window=W):
    """The formula, densely: (1 - g) A_lowrank + g A_band, each a masked softmax matrix, a
    row whose branch sees no key giving all its weight to the other branch."""
    i, j = np.arange(q.shape[0])[:, None], np.arange(L)[None, :]
    real = np.ones(L, bool) if mask is None else np.asarray(mask)
    seen = real[None, :] & ((j <= i) if causal else True)
    band = seen & (np.abs(i - j) <= window)

    def probs(s, visible):
        p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
        return jnp.where(visible.any(1, keepdims=True), p, 0.0)

    a_far = probs((q @ wq) @ (k @ wk).T / np.sqrt(R), seen)
    a_band = probs(q @ k.T / np.sqrt(D), band)
    g = jax.nn.sigmoid(gate)
    w_far = jnp.where(seen.any(1), 1 - g, 0.0)[:, None]
    w_band = jnp.where(band.any(1), g, 0.0)[:, None]
    return ((w_far * a_far + w_band * a_band) / jnp.maximum(w_far + w_band, 1e-30)) @ v


@pytest.mark.parametrize("causal", [False, True])
def test_matches_dense_formula_and_grads(causal):
    q, k, v = _qkv()
    mask = (jnp.arange(L) < 33) & (jnp.arange(L) != 5)
    for m in (None, mask):
        assert_close(lrb(q, k, v, WQ, WK, GATE, window=W, causal=causal, kv_mask=m),
                     _reference(q, k, v, WQ, WK, GATE, causal, m))
    f = lambda *a: jnp.sum(jnp.sin(lrb(*a, window=W, causal=causal, kv_mask=mask)))
    g_ref = lambda *a: jnp.sum(jnp.sin(_reference(*a, causal, mask)))
    args = (q, k, v, WQ, WK, GATE)
    grads = jax.jit(jax.grad(f, argnums=range(6)))(*args)
    expected = jax.jit(jax.grad(g_ref, argnums=range(6)))(*args)
    for name, g, e in zip(("q", "k", "v", "w_q", "w_k", "gate"), grads, expected):
        assert np.all(np.isfinite(g)), name
        assert_close(g, e, EXACT_GRAD, err_msg=name)


def test_gate_limits_are_the_two_branches():
    q, k, v = _qkv(3)
    only_far = lrb(q, k, v, WQ, WK, jnp.asarray(-1e4), window=W)
    assert_close(only_far, dot_product_attention(q @ WQ, k @ WK, v, scale=R ** -0.5))
    only_band = lrb(q, k, v, WQ, WK, jnp.asarray(1e4), window=W)
    assert_close(only_band, dot_product_attention(q, k, v, pattern=Local(W, W)))


def test_cross_attention_shapes():
    q, k, v = _qkv(4, lq=24)
    out = lrb(q, k, v, WQ, WK, GATE, window=W, causal=True)
    assert out.shape == (24, D)
    assert_close(out, _reference(q, k, v, WQ, WK, GATE, True, None))


def test_causal_no_leak():
    q, k, v = _qkv(1)
    cut = 17
    later = jnp.arange(L)[:, None] >= cut
    k2, v2 = jnp.where(later, k + 3.0, k), jnp.where(later, -v, v)
    f = lambda k, v: lrb(q, k, v, WQ, WK, GATE, window=W, causal=True)
    np.testing.assert_array_equal(f(k, v)[:cut], f(k2, v2)[:cut])
    grads = jax.grad(lambda k, v: f(k, v)[:cut].sum(), argnums=(0, 1))(k, v)
    for g in grads:
        assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[cut:] == 0)


def test_padding_invariance_vmap_and_bf16():
    q, k, v = _qkv(2)
    mask = jnp.arange(L) < 29
    f = lambda k, v: lrb(q, k, v, WQ, WK, GATE, window=W, kv_mask=mask)
    k2, v2 = (jnp.where(mask[:, None], x, 20.0) for x in (k, v))
    assert_close(f(k2, v2), f(k, v))
    grads = jax.jit(jax.grad(lambda k, v: jnp.sum(f(k, v) ** 2), argnums=(0, 1)))(k, v)
    for g in grads:
        assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[29:] == 0)
    # Per-head projections and gates through vmap.
    heads = jax.vmap(lambda key: jnp.stack(init_lowrank_band(key, D, R)[:2]))(
        jax.random.split(jax.random.PRNGKey(9), 2))
    batched = jax.vmap(lambda w, g: lrb(q, k, v, w[0], w[1], g, window=W))(
        heads, jnp.array([0.0, 1.0]))
    assert_close(batched[1], lrb(q, k, v, heads[1, 0], heads[1, 1], jnp.asarray(1.0), window=W))
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = lrb(qb, kb, vb, WQ, WK, GATE, window=W)
    assert out.dtype == jnp.bfloat16
    up = lambda x: x.astype(jnp.float32)
    assert_close(out, lrb(up(qb), up(kb), up(vb), WQ, WK, GATE, window=W), dtype=jnp.bfloat16)


def test_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"w_q and w_k must both be \[Dk, r\]"):
        lowrank_band_attention(q, k, v, WQ[:3], WK, GATE, window=W)
    with pytest.raises(ValueError, match=r"w_q and w_k must both be \[Dk, r\]"):
        lowrank_band_attention(q, k, v, WQ, WK[:, :2], GATE, window=W)
    with pytest.raises(ValueError, match="gate must be a scalar"):
        lowrank_band_attention(q, k, v, WQ, WK, jnp.zeros(2), window=W)
    with pytest.raises(ValueError, match="window must be a non-negative integer"):
        lowrank_band_attention(q, k, v, WQ, WK, GATE, window=-1)
    with pytest.raises(ValueError, match="kv_mask must be boolean"):
        lowrank_band_attention(q, k, v, WQ, WK, GATE, window=W, kv_mask=jnp.ones(L))
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        init_lowrank_band(jax.random.PRNGKey(0), D, 0)
