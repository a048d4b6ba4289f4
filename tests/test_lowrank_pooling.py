"""Poolingformer attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import assert_close
from xformers_jax.attention import dot_product_attention, poolingformer_attention
from xformers_jax.attention.patterns import Local

L, D = 30, 8
pf = jax.jit(poolingformer_attention,
             static_argnames=("window", "pool_size", "second_window", "pool", "causal"))


def _qkv(seed=0):
    return tuple(jax.random.normal(jax.random.PRNGKey(seed + i), (L, D)) for i in range(3))


@pytest.mark.parametrize("pool", ["mean", "max"])
def test_matches_two_level_definition(pool):
    q, k, v = _qkv()
    mask = jnp.arange(L) < 22
    out = pf(q, k, v, window=3, pool_size=4, pool=pool, kv_mask=mask)
    first = dot_product_attention(q, k, v, pattern=Local(3, 3), kv_mask=mask)
    slots = [np.arange(s, min(s + 4, 22)) for s in range(0, 22, 4)]
    reduce = (lambda a: a.mean(0)) if pool == "mean" else (lambda a: a.max(0))
    mem_k = jnp.stack([reduce(k[s]) for s in slots])
    mem_v = jnp.stack([reduce(v[s]) for s in slots])
    assert_close(out, first + dot_product_attention(q, mem_k, mem_v))


def test_pool_size_one_and_no_window_is_two_full_attentions():
    q, k, v = _qkv()
    out = pf(q, k, v, window=L, pool_size=1)
    assert_close(out, 2 * dot_product_attention(q, k, v))


def test_second_window_limits_the_pooled_memory():
    q, k, v = _qkv()
    out = pf(q, k, v, window=2, pool_size=5, second_window=3)
    first = dot_product_attention(q, k, v, pattern=Local(2, 2))
    mem_k, mem_v = k.reshape(6, 5, D).mean(1), v.reshape(6, 5, D).mean(1)
    i, s = np.arange(L)[:, None], np.arange(6)[None, :] * 5
    near = (s <= i + 3) & (s + 4 >= i - 3)
    second = dot_product_attention(q, mem_k, mem_v, bias=jnp.where(near, 0.0, -jnp.inf))
    assert_close(out, first + second)


def test_padding_grads_bf16_and_errors():
    q, k, v = _qkv()
    mask = jnp.arange(L) < 19
    f = lambda k, v: pf(q, k, v, window=3, pool_size=4, pool="max", kv_mask=mask)
    k2, v2 = (jnp.where(mask[:, None], x, 25.0) for x in (k, v))
    assert_close(f(k2, v2), f(k, v))
    grads = jax.grad(lambda k, v: jnp.sum(f(k, v) ** 2), argnums=(0, 1))(k, v)
    for g in grads:
        assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[19:] == 0)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = pf(qb, kb, vb, window=3, pool_size=4)
    assert out.dtype == jnp.bfloat16
    assert_close(out, pf(*(x.astype(jnp.float32) for x in (qb, kb, vb)), window=3, pool_size=4),
                 dtype=jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="does not support causal=True"):
        poolingformer_attention(q, k, v, window=3, pool_size=4, causal=True)
    with pytest.raises(ValueError, match="pool must be one of"):
        poolingformer_attention(q, k, v, window=3, pool_size=4, pool="sum")
    with pytest.raises(ValueError, match="pool_size"):
        poolingformer_attention(q, k, v, window=3, pool_size=0)
