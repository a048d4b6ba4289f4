"""Norms, feed-forward networks, attention module semantics (GQA, padding, cross attention),
initialisations, mixed precision and the models' shapes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xformers_jax.models as models
import xformers_jax.nn as nn
from tests.tolerances import EXACT, assert_close

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), (2, 10, 32)) * 3 + 1


def test_norms():
    y = nn.LayerNorm(32)(X)
    assert_close(y.mean(-1), jnp.zeros((2, 10)), EXACT)
    r = nn.RMSNorm(32)(X)
    assert_close(jnp.sqrt(jnp.mean(r ** 2, -1)), jnp.ones((2, 10)), EXACT)
    s = nn.ScaledL2Norm(32)(X)
    assert_close(jnp.linalg.norm(s, axis=-1), jnp.full((2, 10), np.sqrt(32)), EXACT)
    a = nn.AdaNorm()(X)
    z = (X - X.mean(-1, keepdims=True)) / jnp.sqrt(X.var(-1, keepdims=True) + 1e-6)
    assert_close(a, (1 - 0.1 * z) * z, EXACT)
    # AdaNorm's (1 - k y) factor is a constant in the backward pass.
    g = jax.grad(lambda x: nn.AdaNorm()(x).sum())(X)
    g_ln = jax.grad(lambda x: nn.LayerNorm(32)(x).sum())(X)
    assert not np.allclose(g, g_ln)
    with pytest.raises(ValueError, match="unknown norm"):
        nn.make_norm("batch", 32)


def test_power_norm_running_statistics():
    norm, state0 = eqx.nn.make_with_state(nn.PowerNorm)(32, alpha=0.5)

    def fresh():
        # An eqx.nn.State may be used once; clone the initial one per call.
        leaves, treedef = jax.tree_util.tree_flatten(state0)
        return jax.tree_util.tree_unflatten(treedef, leaves)

    y, state = norm(X, fresh())
    assert_close(y, X / jnp.sqrt(1.0 + 1e-6), EXACT)  # first step uses psi_0 = 1
    psi2 = state.get(norm.index)
    assert_close(psi2, 0.5 + 0.5 * jnp.mean(X ** 2, axis=(0, 1)), EXACT)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    y2, state2 = norm(X, jax.tree_util.tree_unflatten(treedef, leaves), inference=True)
    assert_close(y2, X / jnp.sqrt(psi2 + 1e-6), EXACT)
    assert_close(state2.get(norm.index), psi2, EXACT)
    # Padded positions are left out of the statistic.
    mask = jnp.arange(10)[None] < jnp.array([[10], [4]])
    _, s_masked = norm(X.at[1, 4:].set(100.0), fresh(), mask=mask)
    _, s_ref = norm(X.at[1, 4:].set(0.0), fresh(), mask=mask)
    assert_close(s_masked.get(norm.index), s_ref.get(norm.index), EXACT)


@pytest.mark.parametrize("activation", ["relu", "gelu", "swish", "glu", "geglu", "swiglu"])
def test_ffn_chunked_equals_whole(activation):
    ffn = nn.FeedForward(32, 48, activation, key=KEY)
    chunked = nn.FeedForward(32, 48, activation, chunk_size=3, key=KEY)
    assert_close(chunked(X), ffn(X), EXACT)
    assert (ffn.w_gate is not None) == (activation in ("glu", "geglu", "swiglu"))


def test_attention_gqa_padding_and_cross():
    mha = nn.MultiHeadAttention(32, 4, num_kv_heads=1, key=KEY)
    assert mha.wk.shape == (32, 8)
    mask = jnp.arange(10)[None] < jnp.array([[10], [6]])
    a = mha(X, kv_mask=mask)
    b = mha(X.at[1, 6:].set(-7.0), kv_mask=mask)
    assert_close(a[1, :6], b[1, :6], EXACT)
    cross = nn.MultiHeadAttention(32, 4, kv_dim=16, key=KEY)
    ctx = jax.random.normal(KEY, (2, 5, 16))
    assert cross(X, ctx).shape == (2, 10, 32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        nn.MultiHeadAttention(32, 4, num_kv_heads=3, key=KEY)


def test_t_fixup_and_admin():
    t = nn.LayerStack(lambda k: nn.TransformerBlock(32, 4, 64, placement="none", key=k), 4,
                      key=KEY)
    scaled = nn.t_fixup(t)
    assert_close(scaled.layers.attn.wv, t.layers.attn.wv * 0.67 * 4 ** -0.25, EXACT)
    assert_close(scaled.layers.attn.wq, t.layers.attn.wq, EXACT)
    post = nn.LayerStack(lambda k: nn.TransformerBlock(32, 4, 64, placement="post", key=k), 3,
                         key=KEY)
    admin = nn.admin_initialize(post, X)
    omega = np.asarray(admin.layers.gains).ravel()
    assert omega[0] == 1.0 and np.all(np.diff(omega) > 0)
    assert admin(X).shape == X.shape
    with pytest.raises(ValueError, match="post-LN"):
        nn.admin_initialize(t, X)


def test_rezero_block_starts_as_identity():
    block = nn.TransformerBlock(32, 4, 64, placement="rezero", key=KEY)
    assert_close(block(X), X, EXACT)


def test_mixed_precision_policy():
    model = models.EncoderClassifier(3, 32, 2, 4, 64, input_dim=5, pooling="mean", key=KEY)
    pixels = jax.random.normal(KEY, (2, 10, 5))
    policy = nn.Policy()
    out = policy(lambda m, x: m(x), model, pixels)
    assert out.dtype == jnp.float32
    full = model(pixels)
    # bf16 compute through two layers: within 5% of the float32 logits (relative l2 error).
    assert float(jnp.linalg.norm(out - full) / jnp.linalg.norm(full)) < 0.05
    grads = eqx.filter_grad(lambda m: policy(lambda m, x: m(x), m, pixels).sum())(model)
    assert grads.head.dtype == jnp.float32 and bool(jnp.isfinite(grads.head).all())


def test_models():
    tokens = jax.random.randint(KEY, (2, 10), 0, 20)
    mask = jnp.arange(10)[None] < jnp.array([[10], [7]])
    clf = models.EncoderClassifier(3, 32, 1, 4, 64, vocab_size=20, pooling="cls", key=KEY)
    assert clf(tokens, mask=mask).shape == (2, 3)
    # Padding invariance through the whole model.
    other = tokens.at[1, 7:].set(0)
    assert_close(clf(tokens, mask=mask)[1], clf(other, mask=mask)[1], EXACT)
    dual = models.DualEncoder(2, 32, 1, 4, 64, vocab_size=20, key=KEY)
    assert dual(tokens, tokens[::-1], mask_a=mask).shape == (2, 2)
    s2s = models.EncoderDecoder(20, 32, 1, 4, 64, input_dim=3, key=KEY)
    out = s2s(jax.random.normal(KEY, (2, 7, 3)), tokens)
    assert out.shape == (2, 10, 20)
    with pytest.raises(ValueError, match="exactly one of vocab_size"):
        nn.Embedder(32, key=KEY)
    # The table's initial scale: 1 / sqrt(dim) unless given; a given one must be positive.
    drawn = nn.Embedder(32, vocab_size=20, key=KEY).table
    unit = nn.Embedder(32, vocab_size=20, table_std=1.0, key=KEY).table
    assert_close(unit, drawn * np.sqrt(32), EXACT)
    with pytest.raises(ValueError, match="table_std must be positive.*got -1.0"):
        nn.Embedder(32, vocab_size=20, table_std=-1.0, key=KEY)
