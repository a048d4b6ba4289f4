"""Memory-compressed attention with local blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import assert_close
from xformers_jax.attention import (
    dot_product_attention,
    init_memory_compression,
    memory_compressed_attention,
)
from xformers_jax.attention.lowrank._memory_compressed import compress

L, D, STRIDE, BLOCK = 30, 8, 4, 8
WK, WV = init_memory_compression(jax.random.PRNGKey(1), STRIDE, D, D)
mca = jax.jit(memory_compressed_attention, static_argnames=("block_size", "causal"))


def _qkv(seed=0):
    return tuple(jax.random.normal(jax.random.PRNGKey(seed + i), (L, D)) for i in range(3))


def _reference(q, k, v, causal, mask):
    """The definition, densely: one softmax over all L keys and the compressed slots, with
    a [L, L + M] visibility mask."""
    real = jnp.ones((L,), bool) if mask is None else mask
    mem_k = compress(jnp.where(real[:, None], k, 0), WK)
    mem_v = compress(jnp.where(real[:, None], v, 0), WV)
    i = np.arange(L)[:, None]
    j = np.arange(L)[None, :]
    local = (i // BLOCK == j // BLOCK) & real[None, :]
    slots = np.arange(mem_k.shape[0])
    memory = np.asarray(jnp.pad(real, (0, -L % STRIDE)).reshape(-1, STRIDE).any(1))[None, :]
    memory = np.broadcast_to(memory, (L, len(slots)))
    if causal:
        local = local & (j <= i)
        memory = memory & ((slots[None, :] + 1) * STRIDE - 1 <= i)
    seen = jnp.concatenate([local, memory], axis=1)
    bias = jnp.where(seen, 0.0, -jnp.inf)
    return dot_product_attention(q, jnp.concatenate([k, mem_k]), jnp.concatenate([v, mem_v]),
                                 bias=bias)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_dense_definition(causal):
    q, k, v = _qkv()
    mask = jnp.arange(L) < 23
    for m in (None, mask):
        assert_close(mca(q, k, v, WK, WV, block_size=BLOCK, causal=causal, kv_mask=m),
                     _reference(q, k, v, causal, m))


def test_causal_no_leak_and_padding_invariance():
    q, k, v = _qkv()
    cut = 13
    later = jnp.arange(L)[:, None] >= cut
    k2, v2 = jnp.where(later, k + 4.0, k), jnp.where(later, -v, v)
    f = lambda k, v, **kw: mca(q, k, v, WK, WV, block_size=BLOCK, **kw)
    np.testing.assert_array_equal(f(k, v, causal=True)[:cut], f(k2, v2, causal=True)[:cut])
    grads = jax.grad(lambda k, v: f(k, v, causal=True)[:cut].sum(), argnums=(0, 1))(k, v)
    for g in grads:
        assert np.all(np.asarray(g)[cut:] == 0) and np.all(np.isfinite(g))
    mask = jnp.arange(L) < 21
    k3, v3 = (jnp.where(mask[:, None], x, 30.0) for x in (k, v))
    assert_close(f(k3, v3, kv_mask=mask), f(k, v, kv_mask=mask))


def test_bf16_and_errors():
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv())
    out = mca(q, k, v, WK, WV, block_size=BLOCK)
    assert out.dtype == jnp.bfloat16
    ref = mca(*(x.astype(jnp.float32) for x in (q, k, v)), WK, WV, block_size=BLOCK)
    assert_close(out, ref, dtype=jnp.bfloat16)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="Lq == Lk"):
        memory_compressed_attention(q[:5], k, v, WK, WV, block_size=BLOCK)
    with pytest.raises(ValueError, match="wk must be"):
        memory_compressed_attention(q, k, v, WK[:, :3], WV, block_size=BLOCK)
