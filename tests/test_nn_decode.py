"""Decoding: cached logits equal teacher-forced logits position by position (softmax, local
and linear attention), and generate uses them (greedy, temperature, top-k)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xformers_jax.models as models
import xformers_jax.nn as nn
from tests.tolerances import EXACT, assert_close

L = 12
CASES = {
    "dot_product": (nn.AttentionSpec("dot_product"), nn.KVCache),
    "flash": (nn.AttentionSpec("flash", {"block_q": 8, "block_k": 8}), nn.KVCache),
    "local": (nn.AttentionSpec("local", {"left": 3}), nn.KVCache),
    "linear": (nn.AttentionSpec("linear", {"chunk_size": 4}), nn.RecurrentCache),
    "performer": (nn.AttentionSpec("performer", {"num_features": 16, "chunk_size": 4}),
                  nn.RecurrentCache),
}


def _lm(spec, key, **block):
    return models.CausalLM(20, 32, 2, 4, 64, max_len=L, block=dict(spec=spec, **block), key=key)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_logits_equal_teacher_forced(name):
    spec, cache_type = CASES[name]
    key = jax.random.PRNGKey(0)
    model = _lm(spec, key, num_kv_heads=2)
    tokens = jax.random.randint(key, (2, L), 0, 20)

    @eqx.filter_jit
    def both(m):
        return m(tokens), m.prefill(tokens, m.init_cache(2, L))

    forced, (cached, caches) = both(model)
    assert isinstance(caches, cache_type)
    assert_close(cached, forced, EXACT)


def test_tied_embeddings_are_the_output_layer():
    """``tie_embeddings``: no head of its own; the logits (forward, at chosen positions and
    cached) are those of an untied model whose head is the embedding table transposed, and
    the table's gradient gathers both uses."""
    key = jax.random.PRNGKey(4)
    tied = models.CausalLM(20, 32, 2, 4, 64, max_len=L, tie_embeddings=True, key=key)
    assert tied.head is None
    untied = eqx.tree_at(lambda m: m.head, _lm(nn.AttentionSpec("dot_product"), key),
                         tied.embed.table.T, is_leaf=lambda x: x is None)
    untied = eqx.tree_at(lambda m: (m.embed, m.layers, m.final_norm), untied,
                         (tied.embed, tied.layers, tied.final_norm))
    tokens = jax.random.randint(key, (2, L), 0, 20)
    forced = tied(tokens)
    assert_close(forced, untied(tokens), EXACT)
    at = jnp.array([[1, 5], [0, 11]])
    assert_close(tied(tokens, logits_at=at), jnp.take_along_axis(forced, at[..., None], 1),
                 EXACT)
    cached, _ = eqx.filter_jit(lambda m: m.prefill(tokens, m.init_cache(2, L)))(tied)
    assert_close(cached, forced, EXACT)

    def loss(m):
        return m(tokens).sum()

    g_tied = eqx.filter_grad(loss)(tied).embed.table
    g_untied = eqx.filter_grad(loss)(untied)
    assert_close(g_tied, g_untied.embed.table + g_untied.head.T, EXACT)


def test_local_cache_evicts_to_the_window():
    model = _lm(nn.AttentionSpec("local", {"left": 3}), jax.random.PRNGKey(0))
    caches = model.init_cache(2, 100)
    # Ring buffers of window + 1 slots per layer, whatever the length to generate.
    assert caches.k.shape == (2, 2, 4, 4, 8)


def test_rope_and_alibi_decode():
    key = jax.random.PRNGKey(2)
    tokens = jax.random.randint(key, (2, L), 0, 20)
    for position in (nn.RotaryPositions(), nn.ALiBi(4)):
        model = models.CausalLM(20, 32, 2, 4, 64, max_len=L, positions=nn.NoPositions(),
                            block=dict(position=position), key=key)
        cached, _ = eqx.filter_jit(lambda m: m.prefill(tokens, m.init_cache(2, L)))(model)
        assert_close(cached, model(tokens), EXACT)


def test_generate_greedy_matches_argmax_of_forward():
    key = jax.random.PRNGKey(3)
    model = _lm(nn.AttentionSpec("dot_product"), key)
    prompt = jax.random.randint(key, (2, 4), 0, 20)
    out = eqx.filter_jit(lambda m: m.generate(prompt, 5))(model)
    assert out.shape == (2, 9)
    np.testing.assert_array_equal(np.asarray(out[:, :4]), np.asarray(prompt))
    # Each generated token is the argmax of the teacher-forced logits of what precedes it.
    logits = model(out)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits[:, 3:-1], -1)),
                                  np.asarray(out[:, 4:]))


def test_generate_top_k_sampling():
    key = jax.random.PRNGKey(4)
    model = _lm(nn.AttentionSpec("linear", {"chunk_size": 4}), key)
    prompt = jax.random.randint(key, (8, 3), 0, 20)
    gen = eqx.filter_jit(lambda m, k: m.generate(prompt, 4, key=k, top_k=1, temperature=0.5))
    out = gen(model, jax.random.PRNGKey(5))
    # top_k=1 sampling is greedy.
    np.testing.assert_array_equal(np.asarray(out), np.asarray(model.generate(prompt, 4)))
    gen2 = eqx.filter_jit(lambda m, k: m.generate(prompt, 4, key=k, top_k=3, temperature=2.0))
    a, b = gen2(model, jax.random.PRNGKey(6)), gen2(model, jax.random.PRNGKey(7))
    assert a.shape == (8, 7) and not np.array_equal(np.asarray(a), np.asarray(b))
    logits = model(a)
    top3 = jax.lax.top_k(logits[:, 2:-1], 3)[1]
    assert bool((top3 == a[:, 3:, None]).any(-1).all())


def test_non_decodable_kind_has_no_cache():
    model = models.EncoderClassifier(2, 32, 1, 4, 64, vocab_size=10, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="only causal self-attention decodes"):
        model.encoder.layers.init_cache(1, 8)
    lm = models.CausalLM(20, 32, 1, 4, 64, max_len=L, positions=nn.ConvPositions(
        32, key=jax.random.PRNGKey(0)), key=jax.random.PRNGKey(0))
    with pytest.raises(NotImplementedError, match="CPE"):
        lm.init_cache(1, 8)


def test_performer_feature_redraw():
    model = _lm(nn.AttentionSpec("performer", {"num_features": 16}), jax.random.PRNGKey(0))
    old = model.layers.layers.attn.variant_params.value  # a fixed buffer (axes.Buffer)
    new_model = nn.redraw_random_features(model, jax.random.PRNGKey(9))
    new = new_model.layers.layers.attn.variant_params.value
    assert new.shape == old.shape == (2, 16, 8)
    assert not np.allclose(np.asarray(new), np.asarray(old))
    assert not np.allclose(np.asarray(new[0]), np.asarray(new[1]))
    # Everything else is untouched.
    assert_close(new_model.head, model.head, EXACT)
