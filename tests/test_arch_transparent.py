"""Transparent attention: the decoder's contexts against eq. 46 written with an explicit loop
over the blocks; the reduction to the plain encoder-decoder when each decoder layer's weights
select the last encoder layer; gradients reach every combination weight; causal no-leak in the
target; source padding."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xformers_jax.models import TransparentEncoderDecoder
from tests.fast_jit import build, jit0
from tests.tolerances import assert_close

B, LS, LT, DIM, N, VOCAB = 2, 6, 5, 16, 2, 11


@pytest.fixture(scope="module")
def model():
    m = build(lambda key: TransparentEncoderDecoder(VOCAB, DIM, N, 2, 32, vocab_size=VOCAB,
                                                    max_len=8, key=key), 0)
    w = jax.random.normal(jax.random.PRNGKey(1), m.weights.shape)
    return eqx.tree_at(lambda t: t.weights, m, w)


@pytest.fixture(scope="module")
def run():
    return jit0(lambda m, s, t, sm, tm: m(s, t, source_mask=sm, target_mask=tm))


def _data():
    src = jax.random.randint(jax.random.PRNGKey(2), (B, LS), 0, VOCAB)
    tgt = jax.random.randint(jax.random.PRNGKey(3), (B, LT), 0, VOCAB)
    return src, tgt


def _block(stack, i):
    dynamic, static = stack.per_layer()
    return eqx.combine(jax.tree_util.tree_map(lambda a: a[i], dynamic), static)


@jit0
def _reference(model, src, tgt):
    m = model.model
    x, _ = m.encoder.embed(src)
    hs = [x]
    for i in range(N):
        hs.append(_block(m.encoder.layers, i)(hs[-1]))
    w = model.weights
    alpha = jnp.exp(w) / jnp.exp(w).sum(0, keepdims=True)
    y, _ = m.embed(tgt, causal=True)
    for j in range(N):
        ctx = sum(alpha[i, j] * hs[i] for i in range(N + 1))
        y = _block(m.decoder, j)(y, context=m.encoder.final_norm(ctx))
    return m.final_norm(y) @ m.head, m(src, tgt)


def test_matches_eq46_and_reduces_to_plain(model, run):
    src, tgt = _data()
    ref, plain = _reference(model, src, tgt)
    assert_close(run(model, src, tgt, None, None), ref)
    # w[N, j] >> the rest: every decoder layer reads the last encoder layer (the plain model).
    one_hot = eqx.tree_at(lambda t: t.weights, model,
                          jnp.zeros_like(model.weights).at[N].set(60.0))
    assert_close(run(one_hot, src, tgt, None, None), plain)


def test_gradients_nolleak_padding(model, run):
    src, tgt = _data()
    g = jit0(jax.grad(lambda mm: jnp.sum(jnp.sin(mm(src, tgt)))))(model)
    assert bool(jnp.all(jnp.abs(g.weights) > 0))
    assert float(jnp.abs(g.model.encoder.layers.layers.attn.wq[0]).max()) > 0
    base = run(model, src, tgt, None, None)
    t = LT // 2
    moved = run(model, src, tgt.at[:, t].set((tgt[:, t] + 1) % VOCAB), None, None)
    np.testing.assert_allclose(np.asarray(moved[:, :t]), np.asarray(base[:, :t]), atol=1e-6)
    assert float(jnp.abs(moved[:, t:] - base[:, t:]).max()) > 1e-4
    smask = jnp.broadcast_to(jnp.arange(LS + 3) < LS, (B, LS + 3))
    padded = jnp.concatenate([src, jnp.full((B, 3), 4)], 1)
    assert_close(run(model, padded, tgt, smask, None), base)
