"""ELECTRA: the replaced-token labels are exactly the positions the generator changed (a
correct guess is labelled original), padding is never masked, the sample carries no gradient
to the generator, the loss weights, shared embeddings and the fine-tuning classifier."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests._compress_model import fast_jit
from tests.tolerances import assert_close
from xformers_jax import models


@pytest.fixture(scope="module")
def electra():
    m = models.Electra(12, 16, 1, 2, 32, gen_dim=8, gen_heads=1, gen_hidden=16, mask_prob=0.5,
                   max_len=16, key=jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 16), 1, 12).at[:, :8].set(5)
    tokens = tokens.at[3, 12:].set(0)
    return m, tokens, tokens != 0


_corrupt = eqx.filter_jit(lambda m, t, k, mask: m.corrupt(t, k, mask=mask))


def test_labels_are_exactly_the_changed_positions(electra):
    m, tokens, mask = electra
    # A generator that always samples token 5: masked 5s are guessed right (labelled
    # original), every other masked token is replaced.
    m5 = eqx.tree_at(lambda e: e.gen_bias, m, m.gen_bias.at[5].set(1e4))
    masked, corrupted, labels, _ = _corrupt(m5, tokens, jax.random.PRNGKey(3), mask)
    masked, corrupted, labels = map(np.asarray, (masked, corrupted, labels))
    t = np.asarray(tokens)
    assert not masked[~np.asarray(mask)].any()  # padding is never masked
    np.testing.assert_array_equal(corrupted[~masked], t[~masked])
    np.testing.assert_array_equal(corrupted[masked], 5)
    np.testing.assert_array_equal(labels, masked & (t != 5))
    assert (masked & (t == 5)).any() and labels.any()  # both cases occur
    # with the real generator: labels are exactly corrupted != original
    for seed in range(3):
        masked, corrupted, labels, _ = _corrupt(m, tokens, jax.random.PRNGKey(seed), mask)
        np.testing.assert_array_equal(labels, np.asarray(corrupted) != t)
        assert np.all(np.asarray(labels) <= np.asarray(masked))


def test_loss_weights_gradients_and_classifier(electra):
    m, tokens, mask = electra
    key = jax.random.PRNGKey(4)

    @fast_jit
    def parts(m):
        total, metrics = m.loss(tokens, key, mask=mask)
        # the discriminator term alone, differentiated with respect to the generator
        disc_grad = eqx.filter_grad(lambda mm: mm.loss(tokens, key, mask=mask)[1]["disc"])(m)
        return total, metrics, disc_grad

    total, metrics, g = parts(m)
    assert_close(total, metrics["mlm"] + 50.0 * metrics["disc"])
    # the sampled tokens carry no gradient back into the generator
    assert float(jnp.abs(g.gen_layers.layers.ffn.w1).max()) == 0
    assert float(jnp.abs(g.gen_out).max()) == 0
    assert float(jnp.abs(g.disc_head).max()) > 0
    # MLM reference over the masked positions, from the generator's own logits
    masked, _, _, logits = _corrupt(m, tokens, key, mask)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    assert_close(metrics["mlm"], jnp.sum(jnp.where(masked, ce, 0)) / masked.sum())
    # the discriminator's loss trains the embedding table the generator reads (shared)
    assert float(jnp.abs(g.embed.table).max()) > 0

    clf = m.classifier(3, key=jax.random.PRNGKey(5))
    logits = eqx.filter_jit(lambda c: c(tokens, mask=mask))(clf)
    assert logits.shape == (4, 3)
    assert clf.encoder.layers is m.disc_layers
    with pytest.raises(ValueError, match="int"):
        m.corrupt(tokens.astype(jnp.float32), key)
    with pytest.raises(ValueError, match="mask_prob"):
        models.Electra(12, 16, 1, 2, 32, mask_prob=1.5, key=key)
