"""Lite Transformer's LSRA: the convolution branch against an explicit sum over taps, the
attention branch equal to MultiHeadAttention on its half, causal no-leak, padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xformers_jax.mixers import lightweight_conv
from xformers_jax.nn import LSRA
from tests.tolerances import assert_close

B, L, DIM, HEADS, K = 2, 10, 16, 2, 3


def _conv_ref(x, kernel, causal):
    w = np.asarray(jax.nn.softmax(kernel, -1))
    x = np.asarray(x)
    c = x.shape[-1]
    out = np.zeros_like(x)
    for i in range(L):
        for j in range(K):
            src = i - (K - 1) + j if causal else i - (K - 1) // 2 + j
            if 0 <= src < L:
                for ch in range(c):
                    out[:, i, ch] += w[ch // (c // HEADS), j] * x[:, src, ch]
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_lsra_branches_match_references(causal):
    layer = LSRA(DIM, HEADS, kernel_size=K, causal=causal, max_len=L, key=jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (B, L, DIM))
    out = jax.jit(lambda x: layer(x))(x)
    half = DIM // 2
    assert_close(out[..., :half], layer.attn(x[..., :half]))
    g = x[..., half:] @ layer.w_glu
    g = g[..., :half] * jax.nn.sigmoid(g[..., half:])
    assert_close(out[..., half:], _conv_ref(g, layer.kernel, causal) @ np.asarray(layer.w_out))
    if causal:
        t = L // 2
        moved = layer(x.at[:, t].add(1.0))
        np.testing.assert_allclose(np.asarray(moved[:, :t]), np.asarray(out[:, :t]), atol=1e-6)
        assert float(jnp.abs(moved[:, t:] - out[:, t:]).max()) > 1e-3


def test_lsra_padding_and_errors():
    layer = LSRA(DIM, HEADS, kernel_size=K, max_len=L + 4, key=jax.random.PRNGKey(2))
    x = jax.random.normal(jax.random.PRNGKey(3), (B, L, DIM))
    n = L - 3
    mask = jnp.broadcast_to(jnp.arange(L) < n, (B, L))
    a = layer(x, kv_mask=mask)
    junk = layer(x.at[:, n:].set(9.0), kv_mask=mask)
    short = layer(x[:, :n])
    assert_close(a[:, :n], junk[:, :n])
    assert_close(a[:, :n], short)
    with pytest.raises(ValueError, match="must be even"):
        LSRA(15, 3, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="not divisible by"):
        lightweight_conv(jnp.zeros((1, 4, 6)), jnp.zeros((4, 3)), causal=True)
