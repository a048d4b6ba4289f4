"""TokenLearner and Funnel pooling / up-sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import assert_close
from xformers_jax.attention import (
    dot_product_attention,
    funnel_attention,
    funnel_pool,
    funnel_upsample,
    init_token_learner,
    token_learner,
)

L, D = 13, 8
PARAMS = init_token_learner(jax.random.PRNGKey(1), D, 4)


def _x(seed=0, length=L):
    return jax.random.normal(jax.random.PRNGKey(seed), (length, D))


def test_token_learner_definition_padding_and_permutation():
    x = _x()
    w1, b1, w2, b2 = PARAMS
    a = jax.nn.sigmoid(jax.nn.gelu(x @ w1 + b1) @ w2 + b2)
    assert_close(token_learner(x, PARAMS), (a.T @ x) / L)
    mask = jnp.arange(L) < 9
    assert_close(token_learner(jnp.where(mask[:, None], x, 7.0), PARAMS, mask=mask),
                 token_learner(x[:9], PARAMS))
    perm = jax.random.permutation(jax.random.PRNGKey(2), L)
    assert_close(token_learner(x[perm], PARAMS), token_learner(x, PARAMS))
    g = jax.grad(lambda p: token_learner(x, p).sum())(PARAMS)
    assert all(np.all(np.isfinite(leaf)) for leaf in g)


def test_funnel_pool_and_upsample():
    x = _x()
    pooled = funnel_pool(x, 2)
    assert pooled.shape == (7, D)
    assert_close(pooled[:6], x[:12].reshape(6, 2, D).mean(1))
    assert_close(pooled[6], x[12])
    mask = jnp.arange(L) < 5
    pooled_m, valid = funnel_pool(x, 2, mask=mask)
    assert_close(pooled_m[2], x[4])
    np.testing.assert_array_equal(valid, np.arange(7) < 3)
    up = funnel_upsample(pooled, L, 2)
    assert up.shape == (L, D)
    assert_close(up[::2], pooled)
    with pytest.raises(ValueError, match="cannot cover"):
        funnel_upsample(pooled, 20, 2)


def test_funnel_attention_pools_queries_only():
    q, k, v = _x(0), _x(1), _x(2)
    mask = jnp.arange(L) < 10
    out = funnel_attention(q, k, v, stride=3, kv_mask=mask)
    # The padding mask also marks the padded queries (self-attention): they are left out of
    # the pooled queries, and the window of padding only (the last) gives zeros.
    pooled, valid = funnel_pool(q, 3, mask=mask)
    assert_close(out[:4], dot_product_attention(pooled, k, v, kv_mask=mask)[:4])
    assert not np.any(np.asarray(out[4])) and not bool(valid[4])
    every = jnp.ones((L,), bool)  # no query padded: every query pooled
    assert_close(funnel_attention(q, k, v, stride=3, kv_mask=mask, q_mask=every),
                 dot_product_attention(funnel_pool(q, 3), k, v, kv_mask=mask))
    assert funnel_attention(q, k, v, stride=1).shape == (L, D)
    assert_close(funnel_attention(q, k, v, stride=1), dot_product_attention(q, k, v))
    out_b = funnel_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    assert out_b.dtype == jnp.bfloat16
    with pytest.raises(NotImplementedError, match="does not support causal=True"):
        funnel_attention(q, k, v, causal=True)
