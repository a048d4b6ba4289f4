"""Perceiver encoder (Jaegle et al., 2021) and Perceiver AR (Hawthorne et al., 2022)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import assert_close
from xformers_jax.attention import dot_product_attention
from xformers_jax.nn import AttentionSpec, MultiHeadAttention
from xformers_jax.models import PerceiverAR, PerceiverEncoder
from xformers_jax.models._perceiver import _SuffixCausal

N, DIN, DIM, M = 24, 6, 16, 5
KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), (N, DIN))
XA = jax.random.normal(jax.random.PRNGKey(2), (N, DIM))
ENC = PerceiverEncoder(DIN, DIM, M, num_layers=2, num_heads=4, key=KEY)
AR = PerceiverAR(DIM, M, num_layers=2, num_heads=4, key=KEY)
# One sequence through a batched module (a batch of one).
enc = eqx.filter_jit(lambda model, x, mask=None: model(
    x[None], mask=None if mask is None else mask[None])[0])


def test_offset_attention_matches_dense_mask():
    att = MultiHeadAttention(DIM, 4, spec=AttentionSpec("flash", {"pattern": _SuffixCausal()}),
                             key=KEY)
    y = XA
    x = y[N - M:]
    out = att(x[None], y[None])[0]
    heads = lambda a: a.reshape(a.shape[0], 4, -1)
    q, k, v = heads(x @ att.wq), heads(y @ att.wk), heads(y @ att.wv)
    visible = np.arange(N)[None, :] <= np.arange(M)[:, None] + N - M
    ref = jax.vmap(lambda q, k, v: dot_product_attention(
        q, k, v, bias=jnp.where(visible, 0.0, -jnp.inf)), in_axes=1, out_axes=1)(q, k, v)
    assert_close(out, ref.reshape(M, -1) @ att.wo)


def test_encoder_shapes_permutation_and_padding():
    out = enc(ENC, X)
    assert out.shape == (M, DIM)
    # No positions in the input: the latents read it as a set.
    perm = jax.random.permutation(jax.random.PRNGKey(3), N)
    assert_close(enc(ENC, X[perm]), out)
    mask = jnp.arange(N) < 17
    padded = enc(ENC, jnp.where(mask[:, None], X, 7.0), mask)
    assert_close(padded, enc(ENC, X, mask))
    assert_close(padded, enc(ENC, X[:17]))
    batched = eqx.filter_jit(lambda x: ENC(x))(jnp.stack([X, X[perm]]))
    assert_close(batched[1], out)


def test_ar_no_leak_and_grads():
    out = enc(AR, XA)
    assert out.shape == (M, DIM)
    cut = 21  # inputs at positions >= cut change; latent i sits at position N - M + i
    keep = cut - (N - M)
    xa2 = jnp.where(jnp.arange(N)[:, None] >= cut, XA + 5.0, XA)
    np.testing.assert_array_equal(enc(AR, xa2)[:keep], out[:keep])
    assert not np.allclose(enc(AR, xa2)[keep:], out[keep:])
    grads, g_x = eqx.filter_jit(eqx.filter_grad(
        lambda mx: jnp.sum(mx[0](mx[1][None])[0, :keep] ** 2)))((AR, XA))
    assert np.all(np.isfinite(g_x)) and np.all(np.asarray(g_x)[cut:] == 0)
    assert np.any(np.asarray(g_x)[:cut] != 0)
    leaves = jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_array))
    assert leaves and all(np.all(np.isfinite(g)) for g in leaves)
    enc_grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(X[None]) ** 2)))(ENC)
    assert np.any(np.asarray(enc_grads.latents) != 0)
    assert all(np.all(np.isfinite(g))
               for g in jax.tree_util.tree_leaves(eqx.filter(enc_grads, eqx.is_array)))


def test_ar_left_padding():
    # A short prompt left-padded to N: padding never reaches the outputs.
    mask = jnp.arange(N) >= 6
    padded = enc(AR, jnp.where(mask[:, None], XA, -3.0), mask)
    assert_close(padded, enc(AR, XA, mask))
    assert_close(padded, enc(AR, XA[6:]))


def test_errors():
    with pytest.raises(ValueError, match=r"x must be \[B, N, input_dim=6\]"):
        ENC(XA[None])
    with pytest.raises(ValueError, match=r"x must be \[B, N >= num_latents=5, dim=16\]"):
        AR(XA[None, :3])
    with pytest.raises(ValueError, match="multiple of num_heads"):
        PerceiverAR(10, M, num_layers=1, num_heads=4, key=KEY)
