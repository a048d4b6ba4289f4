"""Hierarchical models: HIBERT's document states against running the sentence encoder on each
unpadded sentence alone, taking its last token, and the document encoder on those vectors
(padding of tokens and of whole sentences changes nothing); TNT's sub-patch layout against
explicit pixel indexing, one layer against per-patch inner blocks, and the classifier's
gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xformers_jax.models import HierarchicalEncoder, TNTClassifier
from tests.fast_jit import build, jit0
from tests.tolerances import assert_close

VOCAB, DIM = 13, 16


def test_hibert_matches_per_sentence_composition_and_padding():
    enc = build(lambda key: HierarchicalEncoder(
        VOCAB, DIM, 2, 32, sentence_layers=1, document_layers=1, max_sentence_len=8,
        max_sentences=8, key=key), 0)
    b, s, t = 2, 3, 5
    tokens = jax.random.randint(jax.random.PRNGKey(1), (b, s, t), 0, VOCAB)
    lengths = np.array([[5, 3, 3], [3, 5, 0]])                 # sentence 3 of doc 2 is padding
    mask = jnp.asarray(np.arange(t)[None, None] < lengths[..., None])
    run = jit0(lambda e, x, m: e(x, mask=m))
    h, doc_mask = run(enc, tokens, mask)
    assert doc_mask.tolist() == [[True] * 3, [True, True, False]]
    sentence = jit0(lambda e, t: e.sentence(t)[0][0, -1])   # one unpadded sentence
    document = jit0(lambda e, v: e.document(v[None])[0][0])
    for bi in range(b):
        n_sent = int((lengths[bi] > 0).sum())
        vecs = [sentence(enc, tokens[bi:bi + 1, si, :lengths[bi, si]]) for si in range(n_sent)]
        assert_close(h[bi, :n_sent], document(enc, jnp.stack(vecs)))
    junk = jnp.where(mask, tokens, 7)
    assert_close(run(enc, junk, mask)[0][np.asarray(doc_mask)], h[np.asarray(doc_mask)])
    with pytest.raises(ValueError, match="int\\[B, S, T\\]"):
        enc(tokens[0])


@pytest.fixture(scope="module")
def tnt():
    return build(lambda key: TNTClassifier(3, image_size=8, channels=2, patch=4, word=2, dim=16,
                                           inner_dim=8, depth=1, key=key), 2)


def test_tnt_words_layer_and_gradients(tnt):
    img = jax.random.normal(jax.random.PRNGKey(3), (2, 8, 8, 2))
    words = np.asarray(jit0(lambda m, img: m.words(img))(tnt, img))   # [B, N=4, m=4, 2*2*2]
    assert words.shape == (2, 4, 4, 8)
    pixels = np.asarray(img)
    for pn in range(4):
        for wn in range(4):
            y0, x0 = (pn // 2) * 4 + (wn // 2) * 2, (pn % 2) * 4 + (wn % 2) * 2
            np.testing.assert_array_equal(words[:, pn, wn],
                                          pixels[:, y0:y0 + 2, x0:x0 + 2].reshape(2, -1))
    w = jax.random.normal(jax.random.PRNGKey(4), (2 * 4, 4, 8))
    p = jax.random.normal(jax.random.PRNGKey(5), (2, 5, 16))

    @jit0
    def layer_and_reference(layer, w, p):
        # The inner block on each patch's words alone; the words' projection added to the
        # patches (not the class token); the outer block.
        inner = jnp.stack([layer.inner(w[i:i + 1])[0] for i in range(8)])
        add = layer.norm(inner.reshape(2, 4, -1)) @ layer.proj + layer.proj_b
        return layer(w, p), (inner, layer.outer(p.at[:, 1:].add(add)))

    out, ref = layer_and_reference(tnt.layers[0], w, p)
    assert_close(out, ref)

    @jit0
    def grads_and_flat(m, img):
        g = jax.grad(lambda m: jnp.sum(jnp.sin(m(img))))(m)
        return g, m(img.reshape(2, 64, 2)), m(img)

    g, flat, square = grads_and_flat(tnt, img)
    assert float(jnp.abs(g.word_proj).max()) > 0 and float(jnp.abs(g.cls).max()) > 0
    assert_close(flat, square)
