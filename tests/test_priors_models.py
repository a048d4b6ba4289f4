"""Scores passed between layers inside models (Realformer, Predictive attention, Lazyformer as
registered kinds, carried by the layer stack): Realformer's dense and exact tiled forms agree
through a 3-layer model; Lazyformer with k = 1 and Predictive attention with alpha = 1 are the
vanilla model; a Lazyformer layer that reuses the map really skips its scores (NaN query
weights there leave the output finite); causal no-leak and padding invariance of each kind in
3-layer models; the dense-score error and the carry error."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xformers_jax import models, nn
from tests.fast_jit import build, jit0
from tests.tolerances import assert_close

L, DIM, HEADS, HIDDEN, LAYERS, VOCAB = 8, 16, 2, 32, 3, 17
SPECS = {
    "realformer": {},
    "realformer_tiled": {"implementation": "tiled", "block_q": 4, "block_k": 4},
    "predictive": {"alpha": 0.5},
    "lazy": {"every": 2},
}


def _spec(name):
    return nn.AttentionSpec(name.split("_")[0], SPECS[name])


def _lm(spec, key=0):
    return build(lambda key: models.CausalLM(VOCAB, DIM, LAYERS, HEADS, HIDDEN, max_len=L,
                                         block=dict(spec=spec), key=key), key)


_run = jit0(lambda m, t: m(t))
TOKENS = jax.random.randint(jax.random.PRNGKey(5), (2, L), 0, VOCAB)


def test_realformer_tiled_equals_dense_and_reductions_to_vanilla():
    dense = _lm(_spec("realformer"))
    tiled = _lm(_spec("realformer_tiled"))
    vanilla = _lm(nn.AttentionSpec("dot_product"))
    out = _run(dense, TOKENS)
    assert_close(_run(tiled, TOKENS), out)
    # Residual scores change a multi-layer model (the carry is really threaded).
    assert float(jnp.abs(out - _run(vanilla, TOKENS)).max()) > 1e-3
    base = _run(vanilla, TOKENS)
    assert_close(_run(_lm(nn.AttentionSpec("lazy", {"every": 1})), TOKENS), base)
    assert_close(_run(_lm(nn.AttentionSpec("predictive", {"alpha": 1.0})), TOKENS), base)


def test_lazy_reusing_layer_skips_its_scores():
    model = _lm(_spec("lazy"))  # every=2: layer 1 reuses layer 0's map, layer 2 recomputes
    wq = model.layers.layers.attn.wq
    for layer, finite in ((1, True), (2, False)):
        bad = eqx.tree_at(lambda m: m.layers.layers.attn.wq, model, wq.at[layer].set(jnp.nan))
        assert bool(jnp.all(jnp.isfinite(_run(bad, TOKENS)))) == finite, layer


@pytest.mark.parametrize("name", ["realformer", "predictive", "lazy"])
def test_no_leak_and_padding_in_models(name):
    spec = _spec(name)
    t = L // 2
    changed = TOKENS.at[:, t].set((TOKENS[:, t] + 1) % VOCAB)
    a, b = jit0(lambda m: (m(TOKENS), m(changed)))(_lm(spec))
    np.testing.assert_allclose(np.asarray(a[:, :t]), np.asarray(b[:, :t]), atol=1e-5)
    assert not np.allclose(np.asarray(a[:, t:]), np.asarray(b[:, t:]))
    enc = build(lambda key: models.EncoderClassifier(
        3, DIM, LAYERS, HEADS, HIDDEN, pooling="mean", vocab_size=VOCAB, max_len=L + 4,
        block=dict(spec=spec), key=key), 1)
    n = L - 3
    mask = jnp.broadcast_to(jnp.arange(L) < n, (2, L))
    junk = jnp.where(mask, TOKENS, 3)
    long = jnp.concatenate([TOKENS, jnp.full((2, 4), 5)], 1)
    long_mask = jnp.broadcast_to(jnp.arange(L + 4) < n, (2, L + 4))
    p, q, r = jit0(lambda m: (m(TOKENS, mask=mask), m(junk, mask=mask),
                                        m(long, mask=long_mask)))(enc)
    assert_close(q, p)
    assert_close(r, p)


def test_dense_score_and_carry_errors():
    for kind in ("predictive", "lazy"):
        assert nn.get_kind("attention", kind).adapter.dense_scores
        with pytest.raises(ValueError, match="dense-score kind"):
            nn.MultiHeadAttention(DIM, HEADS, spec=nn.AttentionSpec(
                kind, {"implementation": "tiled"}), key=jax.random.PRNGKey(0))
    assert not nn.get_kind("attention", "realformer").adapter.dense_scores
    layer = nn.MultiHeadAttention(DIM, HEADS, spec=_spec("realformer"), key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="passes scores from layer to layer"):
        layer(jnp.ones((1, L, DIM)))
