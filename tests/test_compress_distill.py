"""Distillation: Hinton's KD, DistilBERT's cosine loss and TinyBERT's losses against numpy
references; per-layer hidden states and score maps against the model itself; DistilBERT's
every-other-layer student; a student trained with KD moves towards its teacher."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests._compress_model import small_classifier
from tests.tolerances import assert_close
from xformers_jax import compress as C


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_kd_loss_matches_reference():
    r = np.random.default_rng(0)
    s, t = r.normal(size=(3, 5, 7)), r.normal(size=(3, 5, 7)) * 2
    mask = r.random((3, 5)) > 0.3
    for temp in (1.0, 4.0):
        lp, lq = _np_log_softmax(t / temp), _np_log_softmax(s / temp)
        kl = (np.exp(lp) * (lp - lq)).sum(-1)
        assert_close(C.kd_loss(jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32), temp),
                     temp ** 2 * kl.mean())
        assert_close(C.kd_loss(jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32), temp,
                               mask=jnp.asarray(mask)), temp ** 2 * kl[mask].mean())
    # its gradient in the student logits is (q - p) * T / n, none to the teacher
    g = jax.grad(lambda a, b: C.kd_loss(a, b, 2.0), argnums=(0, 1))(
        jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32))
    p, q = np.exp(_np_log_softmax(t / 2)), np.exp(_np_log_softmax(s / 2))
    assert_close(g[0], (q - p) * 2 / 15)
    assert float(jnp.abs(g[1]).max()) == 0
    with pytest.raises(ValueError, match="differ"):
        C.kd_loss(jnp.ones((2, 3)), jnp.ones((2, 4)))


def test_hidden_losses_match_reference():
    r = np.random.default_rng(1)
    hs, ht = r.normal(size=(2, 4, 8)), r.normal(size=(2, 4, 8))
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
    cos = (hs * ht).sum(-1) / (np.linalg.norm(hs, axis=-1) * np.linalg.norm(ht, axis=-1))
    assert_close(C.cosine_hidden_loss(jnp.asarray(hs, jnp.float32), jnp.asarray(ht, jnp.float32),
                                      jnp.asarray(mask)), (1 - cos)[mask].mean())
    w = r.normal(size=(6, 8))
    small = r.normal(size=(2, 4, 6))
    assert_close(C.hidden_mse_loss(jnp.asarray(small, jnp.float32), jnp.asarray(ht, jnp.float32),
                                   jnp.asarray(w, jnp.float32), jnp.asarray(mask)),
                 ((small @ w - ht) ** 2).mean(-1)[mask].mean())
    a, b = r.normal(size=(2, 3, 4, 4)), r.normal(size=(2, 3, 4, 4))
    pair = mask[:, None, :, None] & mask[:, None, None, :]
    assert_close(C.attention_map_loss(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                                      jnp.asarray(mask)),
                 ((a - b) ** 2)[np.broadcast_to(pair, a.shape)].mean())
    assert C.layer_map(2, 4) == [0, 2, 4]
    with pytest.raises(ValueError, match="multiple"):
        C.layer_map(3, 4)


@pytest.fixture(scope="module")
def teacher():
    m = small_classifier()
    x = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 1, 10).at[1, 6:].set(0)
    return m, x


def test_hidden_states_scores_and_distilbert_student(teacher):
    m, x = teacher
    mask = x != 0

    @eqx.filter_jit
    def run(m):
        hs, maps, real = C.hidden_states(m, x, mask=mask, scores=True)
        enc, _ = m.encoder(x, mask=mask)
        # reference for layer 0's maps: its attention output from softmax(maps) and v
        block = eqx.combine(jax.tree.map(lambda a: a[0], m.encoder.layers.per_layer()[0]),
                            m.encoder.layers.per_layer()[1])
        h = block.norms[0](hs[0])
        _, _, v = block.attn.project(h, None)
        p = jax.nn.softmax(jnp.where(real[:, None, None, :], maps[0], -jnp.inf), -1)
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(*h.shape[:2], -1) @ block.attn.wo
        o = jnp.where(real[..., None], o, 0)
        return hs, m.encoder.final_norm(hs[-1]), enc, o, block.attn(h, kv_mask=real)

    hs, last, enc, o, ref_o = run(m)
    assert len(hs) == 3 and hs[0].shape == (2, 9, 16)
    assert_close(last, enc)
    assert_close(o, ref_o)

    student = C.distilbert_init(m)
    assert student.encoder.layers.num_layers == 1
    np.testing.assert_array_equal(student.encoder.layers.layers.ffn.w1[0],
                                  m.encoder.layers.layers.ffn.w1[0])
    np.testing.assert_array_equal(student.head, m.head)

    proj = C.TinyBertProjections(16, 16, 1, key=jax.random.PRNGKey(2))
    loss, parts = eqx.filter_jit(lambda s, p: C.tinybert_loss(s, m, p, x, mask=mask))(
        student, proj)
    assert float(parts["attention"]) > 0 and float(parts["hidden"]) > 0
    g = eqx.filter_jit(eqx.filter_grad(
        lambda sp: C.tinybert_loss(sp[0], m, sp[1], x, mask=mask)[0]))((student, proj))
    assert float(jnp.abs(g[1].w).sum()) > 0
    assert float(jnp.abs(g[0].encoder.layers.layers.attn.wq).sum()) > 0


class _MLP(eqx.Module):
    w1: jax.Array
    w2: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.w1) @ self.w2


def test_student_trained_with_kd_moves_towards_teacher():
    r = np.random.default_rng(3)
    mk = lambda h, s: _MLP(jnp.asarray(r.normal(size=(6, h)) / s, jnp.float32),  # noqa: E731
                           jnp.asarray(r.normal(size=(h, 5)) / s, jnp.float32))
    teacher, student = mk(32, 1.0), mk(8, 3.0)
    x = jnp.asarray(r.normal(size=(64, 6)), jnp.float32)
    t_logits = teacher(x)
    opt = optax.adam(3e-2)

    @jax.jit
    def step(s, o):
        loss, g = jax.value_and_grad(lambda s: C.kd_loss(s(x), t_logits, 2.0))(s)
        u, o = opt.update(g, o, s)
        return optax.apply_updates(s, u), o, loss

    o = opt.init(student)
    agree0 = float((student(x).argmax(-1) == t_logits.argmax(-1)).mean())
    losses = []
    for _ in range(60):
        student, o, loss = step(student, o)
        losses.append(float(loss))
    agree = float((student(x).argmax(-1) == t_logits.argmax(-1)).mean())
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    assert agree > agree0 and agree > 0.6
