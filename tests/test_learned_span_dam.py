"""Adaptive attention span and SparseBERT's differentiable attention mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax.attention import (
    adaptive_span_attention, adaptive_span_penalty, dam_attention, dam_mask, dam_penalty,
    dot_product_attention, init_dam_logits, multihead,
)

L, D = 96, 16


def _qkv(key=jax.random.PRNGKey(0), dtype=jnp.float32):
    a, b, c = jax.random.split(key, 3)
    return tuple(jax.random.normal(x, (L, D), dtype) for x in (a, b, c))


def _span_reference(q, k, v, span, max_span, ramp, causal, kv_mask=None):
    z = jnp.clip(span, 0, max_span)
    dist = jnp.abs(jnp.arange(L)[:, None] - jnp.arange(L)[None, :])
    m = jnp.clip((ramp + z - dist) / ramp, 0.0, 1.0)
    bias = jnp.where(m > 0, jnp.log(jnp.where(m > 0, m, 1.0)), -jnp.inf)
    return dot_product_attention(q, k, v, bias=bias, causal=causal, kv_mask=kv_mask)


@pytest.mark.parametrize("causal", [False, True])
def test_adaptive_span_matches_dense_soft_mask_with_grads(causal):
    q, k, v = _qkv()
    mask = jnp.arange(L) < 90
    f = lambda q, k, v, s: adaptive_span_attention(q, k, v, s, max_span=24, ramp=8,
                                                   causal=causal, kv_mask=mask)
    r = lambda q, k, v, s: _span_reference(q, k, v, s, 24, 8, causal, mask)
    span = jnp.float32(10.5)
    assert_close(f(q, k, v, span), r(q, k, v, span))
    g = jax.grad(lambda *a: (f(*a) ** 2).sum(), argnums=(0, 1, 2, 3))(q, k, v, span)
    gr = jax.grad(lambda *a: (r(*a) ** 2).sum(), argnums=(0, 1, 2, 3))(q, k, v, span)
    for a, b in zip(g, gr):
        assert_close(a, b, EXACT_GRAD)
    assert float(g[3]) != 0.0


def test_adaptive_span_limits_reach_causal_no_leak_and_bf16():
    q, k, v = _qkv()
    f = lambda k, v, s: adaptive_span_attention(q, k, v, s, max_span=16, ramp=4, causal=True)
    span = jnp.float32(6.0)
    # Keys further than span + ramp back, and all future keys, have no influence.
    t = 50
    out = f(k, v, span)
    far = jnp.arange(L) < t - 6 - 4
    k2 = jnp.where(far[:, None] | (jnp.arange(L) > t)[:, None], 3.0, k)
    np.testing.assert_array_equal(out[t], f(k2, v, span)[t])
    gv = jax.grad(lambda v: f(k, v, span)[t].sum())(v)
    nz = np.nonzero(np.abs(np.asarray(gv)).sum(1))[0]
    assert nz.min() > t - 10 and nz.max() == t
    # spans are clamped to [0, max_span]
    assert_close(f(k, v, jnp.float32(100.0)), f(k, v, jnp.float32(16.0)))
    qb, kb, vb = (a.astype(jnp.bfloat16) for a in (q, k, v))
    ob = adaptive_span_attention(qb, kb, vb, span, max_span=16, ramp=4)
    assert ob.dtype == jnp.bfloat16
    assert_close(ob, adaptive_span_attention(q, k, v, span, max_span=16, ramp=4),
                 dtype=jnp.bfloat16)


def test_adaptive_span_per_head_penalty_and_errors():
    q = jax.random.normal(jax.random.PRNGKey(1), (2, L, 3, D))
    spans = jnp.array([2.0, 8.0, 30.0])
    f = multihead(lambda q, k, v, s: adaptive_span_attention(q, k, v, s, max_span=16, ramp=4),
                  arg_axes=("heads",))
    out = jax.jit(f)(q, q, q, spans)
    assert out.shape == q.shape
    g = jax.grad(lambda s: f(q, q, q, s).sum() + adaptive_span_penalty(s, 16))(spans)
    assert np.isfinite(g).all()
    np.testing.assert_allclose(adaptive_span_penalty(spans, 16), (2 + 8 + 16) / 16)
    with pytest.raises(ValueError, match="span must be a scalar"):
        adaptive_span_attention(q[0, :, 0], q[0, :, 0], q[0, :, 0], spans, max_span=16)
    with pytest.raises(ValueError, match="ramp must be a positive integer"):
        adaptive_span_attention(q[0, :, 0], q[0, :, 0], q[0, :, 0], 1.0, max_span=16, ramp=0)


def test_dam_mask_structure_and_gumbel():
    logits = jax.random.normal(jax.random.PRNGKey(2), (2 * L - 1,))
    m = np.asarray(dam_mask(logits, L, temperature=0.5))
    # tied diagonals: constant along each diagonal (away from the always-on edges)
    inner = m[1:-1, 1:-1]
    for off in (-5, 0, 7):
        d = np.diagonal(inner, off)
        np.testing.assert_allclose(d, d[0])
    np.testing.assert_array_equal(m[0], 1)
    np.testing.assert_array_equal(m[:, -1], 1)
    m_noise = dam_mask(logits, L, temperature=0.5, key=jax.random.PRNGKey(3))
    assert np.abs(np.asarray(m_noise) - m).max() > 0.1
    np.testing.assert_array_equal(m_noise, dam_mask(logits, L, temperature=0.5,
                                                   key=jax.random.PRNGKey(3)))
    # As tau -> 0 the Gumbel-sigmoid becomes binary.
    hard = np.asarray(dam_mask(logits, L, temperature=1e-4, key=jax.random.PRNGKey(3)))
    assert np.mean((hard < 1e-3) | (hard > 1 - 1e-3)) > 0.99
    full = init_dam_logits(L, tied_diagonals=False)
    assert dam_mask(full, L).shape == (L, L)
    with pytest.raises(ValueError, match="logits must have shape"):
        dam_mask(jnp.zeros(7), L)


def test_dam_attention_reference_grads_padding():
    q, k, v = _qkv()
    logits = 2.0 * jax.random.normal(jax.random.PRNGKey(4), (2 * L - 1,))
    mask = jnp.arange(L) < 80
    out, m = dam_attention(q, k, v, logits, kv_mask=mask, key=jax.random.PRNGKey(5),
                           return_mask=True)
    w = np.asarray(m) * np.exp(np.asarray(q @ k.T) / np.sqrt(D)) * np.asarray(mask)[None]
    ref = (w / w.sum(1, keepdims=True)) @ np.asarray(v)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)
    loss = lambda a: (dam_attention(q, k, v, a, kv_mask=mask, key=jax.random.PRNGKey(5)) ** 2
                      ).sum() + 0.1 * dam_penalty(dam_mask(a, L, key=jax.random.PRNGKey(5)))
    g = jax.grad(loss)(logits)
    assert np.isfinite(g).all() and np.abs(g).max() > 0
    out2 = dam_attention(q, k.at[80:].set(9.0), v.at[80:].set(9.0), logits, kv_mask=mask)
    np.testing.assert_array_equal(dam_attention(q, k, v, logits, kv_mask=mask), out2)
    ob = dam_attention(*(a.astype(jnp.bfloat16) for a in (q, k, v)), logits)
    assert ob.dtype == jnp.bfloat16
    with pytest.raises(NotImplementedError, match="dam_attention does not support causal"):
        dam_attention(q, k, v, logits, causal=True)
    with pytest.raises(ValueError, match="Lq must equal Lk"):
        dam_attention(q[:10], k, v, logits)
