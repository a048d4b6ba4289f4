"""Long-Short Transformer attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import assert_close
from xformers_jax.attention import (
    dot_product_attention,
    init_long_short_projection,
    long_short_attention,
)

L, D, R = 30, 8, 3
WP = init_long_short_projection(jax.random.PRNGKey(1), D, R)
ls = jax.jit(long_short_attention, static_argnames=("window", "causal", "segment_size"))


def _qkv(seed=0):
    return tuple(jax.random.normal(jax.random.PRNGKey(seed + i), (L, D)) for i in range(3))


def _reference(q, k, v, window, causal, segment, mask):
    """The definition, densely: one softmax over [keys, projected slots] with a visibility
    mask, the projections written per segment."""
    real = np.ones(L, bool) if mask is None else np.asarray(mask)
    segment = segment or L
    pks, pvs, seen_slots = [], [], []
    i = np.arange(L)[:, None]
    for start in range(0, L, segment):
        idx = np.arange(start, min(start + segment, L))
        idx = idx[real[idx]]
        p = jax.nn.softmax(k[idx] @ WP, axis=0)
        pks.append(p.T @ k[idx])
        pvs.append(p.T @ v[idx])
        visible = (start + segment <= i) if causal else np.ones((L, 1), bool)
        seen_slots.append(np.broadcast_to(visible, (L, R)))
    j = np.arange(L)[None, :]
    local = (np.abs(i - j) <= window) if not causal else ((j <= i) & (j >= i - window))
    seen = np.concatenate([local & real[None, :]] + seen_slots, axis=1)
    return dot_product_attention(q, jnp.concatenate([k] + pks), jnp.concatenate([v] + pvs),
                                 bias=jnp.where(seen, 0.0, -jnp.inf))


@pytest.mark.parametrize("causal", [False, True])
def test_matches_dense_definition(causal):
    q, k, v = _qkv()
    segment = 7 if causal else None
    mask = jnp.arange(L) < 26
    for m in (None, mask):
        out = ls(q, k, v, WP, window=4, causal=causal, segment_size=segment, kv_mask=m)
        assert_close(out, _reference(q, k, v, 4, causal, segment, m))


def test_causal_no_leak():
    q, k, v = _qkv()
    cut = 16
    later = jnp.arange(L)[:, None] >= cut
    k2, v2 = jnp.where(later, k + 3.0, k), jnp.where(later, -v, v)
    f = lambda k, v: ls(q, k, v, WP, window=4, causal=True, segment_size=7)
    np.testing.assert_array_equal(f(k, v)[:cut], f(k2, v2)[:cut])
    grads = jax.grad(lambda k, v: f(k, v)[:cut].sum(), argnums=(0, 1))(k, v)
    for g in grads:
        assert np.all(np.asarray(g)[cut:] == 0) and np.all(np.isfinite(g))


def test_padding_bf16_and_errors():
    q, k, v = _qkv()
    mask = jnp.arange(L) < 20
    f = lambda k, v: ls(q, k, v, WP, window=4, kv_mask=mask)
    k2, v2 = (jnp.where(mask[:, None], x, 20.0) for x in (k, v))
    assert_close(f(k2, v2), f(k, v))
    grads = jax.grad(lambda k, v: jnp.sum(f(k, v) ** 2), argnums=(0, 1))(k, v)
    for g in grads:
        assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[20:] == 0)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = ls(qb, kb, vb, WP, window=4)
    assert out.dtype == jnp.bfloat16
    assert_close(out, ls(*(x.astype(jnp.float32) for x in (qb, kb, vb)), WP, window=4),
                 dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="needs segment_size"):
        long_short_attention(q, k, v, WP, window=4, causal=True)
    with pytest.raises(ValueError, match=r"w_p must be \[Dk, r\]"):
        long_short_attention(q, k, v, WP[:3], window=4)
