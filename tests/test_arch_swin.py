"""Swin Transformer: (shifted) window attention against full attention over the image grid
restricted to the paper's effective windows with the relative position bias, outputs and
gradients; patch merging; the classifier end to end; errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xformers_jax.models import (PatchMerging, SwinClassifier, WindowAttention,
                                   window_groups)
from tests.tolerances import EXACT_GRAD, assert_close

S, M, C, HEADS = 8, 4, 8, 2


def _reference(attn, x, shift):
    """Attention over all S*S tokens, allowed within one (shifted) window of the unshifted
    grid, plus B[dy + M - 1, dx + M - 1] (eqs. 4-5 of Liu et al., 2021)."""
    b = x.shape[0]
    t = x.reshape(b, S * S, C)
    qkv = (t @ attn.wqkv).reshape(b, S * S, 3, HEADS, C // HEADS)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    g = window_groups(S, S, M, shift)
    same = g[:, None] == g[None, :]
    y, xx = np.divmod(np.arange(S * S), S)
    dy, dx = y[:, None] - y[None, :], xx[:, None] - xx[None, :]
    idx = np.clip((dy + M - 1) * (2 * M - 1) + dx + M - 1, 0, (2 * M - 1) ** 2 - 1)
    bias = jnp.moveaxis(attn.rel_table[idx], -1, 0)                  # [heads, N, N]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(C // HEADS) + bias
    s = jnp.where(same, s, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, S * S, C)
    return (out @ attn.wo).reshape(b, S, S, C)


@pytest.mark.parametrize("shift", [0, M // 2])
def test_window_attention_matches_masked_full_attention(shift):
    attn = WindowAttention(C, HEADS, M, key=jax.random.PRNGKey(0))
    attn = eqx.tree_at(lambda a: a.rel_table, attn,
                       jax.random.normal(jax.random.PRNGKey(1), attn.rel_table.shape))
    x = jax.random.normal(jax.random.PRNGKey(2), (2, S, S, C))
    params, static = eqx.partition(attn, eqx.is_inexact_array)

    def loss(fn):
        return lambda p, x: jnp.sum(jnp.sin(fn(eqx.combine(p, static), x)))

    ours = lambda a, x: a(x, shift)  # noqa: E731
    ref = lambda a, x: _reference(a, x, shift)  # noqa: E731
    assert_close(eqx.filter_jit(ours)(attn, x), ref(attn, x))
    g = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(params, x)
    gr = jax.grad(loss(ref), argnums=(0, 1))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(gr)):
        assert_close(a, b, EXACT_GRAD)
    if shift:   # the shift changes which tokens meet: not the unshifted windows
        assert float(jnp.abs(ours(attn, x) - attn(x, 0)).max()) > 1e-3


def test_patch_merging_and_classifier():
    x = jax.random.normal(jax.random.PRNGKey(3), (2, S, S, C))
    merge = PatchMerging(C, key=jax.random.PRNGKey(4))
    y = merge(x)
    assert y.shape == (2, S // 2, S // 2, 2 * C)
    # Token (i, j) of the output sees exactly the 2 x 2 group at (2i, 2j).
    moved = merge(x.at[:, 2, 3].add(1.0))
    changed = np.asarray(jnp.abs(moved - y).max(axis=(0, 3)) > 0)
    expect = np.zeros((S // 2, S // 2), bool)
    expect[1, 1] = True
    np.testing.assert_array_equal(changed, expect)
    model = SwinClassifier(3, image_size=16, channels=1, patch=2, dim=8, depths=(2, 2),
                           heads=(2, 2), window=4, key=jax.random.PRNGKey(5))
    pixels = jax.random.normal(jax.random.PRNGKey(6), (2, 256, 1))   # LRA-style flattened
    params, static = eqx.partition(model, eqx.is_inexact_array)
    (_, logits), grads = jax.jit(jax.value_and_grad(
        lambda p: (lambda y: (jnp.sum(y ** 2), y))(eqx.combine(p, static)(pixels)),
        has_aux=True))(params)
    assert logits.shape == (2, 3) and bool(jnp.isfinite(logits).all())
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(bool(jnp.isfinite(g).all()) for g in leaves)
    assert float(jnp.abs(grads.stages[1][1].attn.rel_table).sum()) > 0
    with pytest.raises(ValueError, match="multiple of the window"):
        SwinClassifier(3, image_size=12, window=4, depths=(2, 2), heads=(2, 2),
                       key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"images must be \[B, 16, 16, 1\]"):
        model(jnp.zeros((2, 8, 8, 1)))
