"""multihead: lifting one-head functions to [B, L, H, D], grouped-query attention, keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import assert_close
from xformers_jax.attention import dot_product_attention, flash_attention, multihead


def _inputs(key, b=2, lq=12, lk=10, h=4, hkv=4, d=8):
    kq, kk, kv = jax.random.split(key, 3)
    return (jax.random.normal(kq, (b, lq, h, d)), jax.random.normal(kk, (b, lk, hkv, d)),
            jax.random.normal(kv, (b, lk, hkv, d)))


def test_equals_a_loop_over_batch_and_heads(key):
    q, k, v = _inputs(key)
    mask = jnp.array([[True] * 10, [True] * 6 + [False] * 4])
    out = multihead(dot_product_attention)(q, k, v, kv_mask=mask)
    assert out.shape == (2, 12, 4, 8)
    for b in range(2):
        for h in range(4):
            assert_close(out[b, :, h], dot_product_attention(q[b, :, h], k[b, :, h], v[b, :, h],
                                                             kv_mask=mask[b]))


@pytest.mark.parametrize("hkv", [1, 2])
def test_grouped_query_attention_shares_kv_heads(key, hkv):
    q, k, v = _inputs(key, hkv=hkv)
    out = multihead(flash_attention)(q, k, v, causal=True)
    rep = 4 // hkv
    ref = multihead(dot_product_attention)(q, jnp.repeat(k, rep, axis=2),
                                           jnp.repeat(v, rep, axis=2), causal=True)
    assert_close(out, ref)


def test_keys_differ_per_head_and_aux_outputs_are_batch_heads(key):
    q, k, v = _inputs(key, lq=10)
    q = jnp.broadcast_to(q[:, :, :1], q.shape)
    k = jnp.broadcast_to(k[:, :, :1], k.shape)
    v = jnp.broadcast_to(v[:, :, :1], v.shape)
    out = multihead(dot_product_attention)(q, k, v, dropout_rate=0.5, key=key)
    assert not np.allclose(out[0, :, 0], out[0, :, 1])
    out, lse = multihead(flash_attention)(q, k, v, return_lse=True)
    assert out.shape == (2, 10, 4, 8) and lse.shape == (2, 4, 10)


@pytest.mark.parametrize("b,h,hkv", [(1, 4, 4), (1, 1, 1), (2, 4, 1), (1, 4, 2)])
def test_size_one_levels_equal_the_loop(key, b, h, hkv):
    """A batch, kv-head or group level of size 1 is indexed away instead of vmapped (faster on
    XLA:CPU): outputs, aux outputs, per-batch masks and per-head arguments match a loop."""
    q, k, v = _inputs(key, b=b, h=h, hkv=hkv)
    mask = jnp.array([[True] * 6 + [False] * 4, [True] * 10])[:b]
    scales = jnp.linspace(0.5, 1.0, h)

    def fn(q, k, v, s, kv_mask=None):
        return flash_attention(q * s, k, v, kv_mask=kv_mask, return_lse=True)

    out, lse = multihead(fn, arg_axes=("heads",))(q, k, v, scales, kv_mask=mask)
    assert out.shape == (b, 12, h, 8) and lse.shape == (b, h, 12)
    rep = h // hkv
    for i in range(b):
        for j in range(h):
            o, l = flash_attention(q[i, :, j] * scales[j], k[i, :, j // rep],
                                   v[i, :, j // rep], kv_mask=mask[i], return_lse=True)
            assert_close(out[i, :, j], o)
            assert_close(lse[i, j], l)
    if h > 1:  # every head still draws its own randomness
        same = jnp.broadcast_to(q[:, :, :1], q.shape)
        out = multihead(dot_product_attention)(same, k[:, :, :1].repeat(hkv, 2),
                                               v[:, :, :1].repeat(hkv, 2), dropout_rate=0.5,
                                               key=key)
        assert not np.allclose(out[0, :, 0], out[0, :, 1])


def test_per_head_positional_arguments(key):
    q, k, v = _inputs(key)
    scales = jnp.array([0.1, 0.2, 0.3, 0.4])

    def scaled(q, k, v, s):
        return dot_product_attention(q * s, k, v)

    out = multihead(scaled, arg_axes=("heads",))(q, k, v, scales)
    assert_close(out[:, :, 2], multihead(dot_product_attention)(q * 0.3, k, v)[:, :, 2])


def test_errors_name_the_shapes(key):
    q, k, v = _inputs(key)
    with pytest.raises(ValueError, match=r"rank 4.*q\(12, 4, 8\)"):
        multihead(dot_product_attention)(q[0], k[0], v[0])
    q3, k3, v3 = _inputs(key, h=4, hkv=3)
    with pytest.raises(ValueError, match="multiple of the 3 key/value heads"):
        multihead(dot_product_attention)(q3, k3, v3)
    with pytest.raises(ValueError, match=r"leading axes must be \(4,\)"):
        multihead(lambda q, k, v, s: q, arg_axes=("heads",))(q, k, v, jnp.ones(3))
