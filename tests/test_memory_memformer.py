"""Memformer (models.Memformer): the slot writer against numpy, no leak across segments, and
memory replay back-propagation equal to plain autodiff over the unrolled segments."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import models

L, DIM, HEADS, VOCAB, B, SLOTS, SEGS = 8, 16, 2, 11, 2, 3, 2
HD = DIM // HEADS
_JIT = dict(compiler_options={"xla_backend_optimization_level": 0})
MODEL = models.Memformer(VOCAB, DIM, 1, HEADS, 2 * DIM, num_slots=SLOTS, key=jax.random.key(0))


def test_slot_writer_matches_numpy():
    rng = np.random.default_rng(0)
    slots = rng.normal(size=(B, SLOTS, DIM)).astype(np.float32)
    h = rng.normal(size=(B, L, DIM)).astype(np.float32)
    mask = np.ones((B, L), bool)
    mask[1, -2:] = False
    got = MODEL.write(jnp.asarray(slots), jnp.asarray(h), jnp.asarray(mask))
    wq, wk, wv, wo = (np.asarray(w) for w in (MODEL.wq, MODEL.wk, MODEL.wv, MODEL.wo))
    out = np.zeros_like(slots)
    for b in range(B):
        for i in range(SLOTS):
            ctx = np.concatenate([slots[b, i:i + 1], h[b][mask[b]]])  # itself, then the segment
            heads = []
            for hh in range(HEADS):
                sl = slice(hh * HD, (hh + 1) * HD)
                q = (slots[b, i] @ wq)[sl]
                s = (ctx @ wk)[:, sl] @ q / np.sqrt(HD)
                p = np.exp(s - s.max())
                heads.append((p / p.sum()) @ (ctx @ wv)[:, sl])
            out[b, i] = slots[b, i] + np.concatenate(heads) @ wo
    mu, var = out.mean(-1, keepdims=True), out.var(-1, keepdims=True)
    assert_close(got, (out - mu) / np.sqrt(var + 1e-6))


def _step(params, slots, segment):
    model = eqx.combine(params, STATIC)
    logits, new = model(segment[:, :-1], slots)
    y = segment[:, 1:]
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1).mean(), new


PARAMS, STATIC = eqx.partition(MODEL, eqx.is_inexact_array)


def test_memory_replay_gradients_equal_plain_autodiff_over_unrolled_segments():
    segments = jax.random.randint(jax.random.key(1), (SEGS, B, L + 1), 1, VOCAB)
    slots = MODEL.initial_slots(B)

    def unrolled(params, s):
        total = 0.0
        for t in range(SEGS):
            loss, s = _step(params, s, segments[t])
            total = total + loss
        return total, s

    (want_loss, want_final), (want, want_slots) = jax.jit(
        jax.value_and_grad(unrolled, argnums=(0, 1), has_aux=True), **_JIT)(PARAMS, slots)
    loss, grads, final, g_slots = jax.jit(
        lambda p: models.memory_replay_gradients(_step, p, slots, segments), **_JIT)(PARAMS)
    assert_close(loss, want_loss)
    assert_close(final, want_final)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        assert_close(a, b, EXACT_GRAD)
    # Gradients cross segments: the losses reach the memory the first segment started from.
    assert float(jnp.abs(g_slots).max()) > 0
    assert_close(g_slots, want_slots, EXACT_GRAD)


def test_no_leak_across_segments_and_memory_carries_information():
    tokens = jax.random.randint(jax.random.key(2), (B, 3 * L), 1, VOCAB)

    @jax.jit
    def run(tokens):
        s, outs = MODEL.initial_slots(B), []
        for t in range(3):
            logits, s = MODEL(tokens[:, t * L:(t + 1) * L], s)
            outs.append(logits)
        return jnp.concatenate(outs, 1), s

    a, slots = run(tokens)
    assert slots.shape == (B, SLOTS, DIM)
    t = L + L // 2
    b, _ = run(tokens.at[:, t].set(tokens[:, t] % (VOCAB - 1) + 1))
    np.testing.assert_array_equal(np.asarray(a[:, :t]), np.asarray(b[:, :t]))
    assert float(jnp.abs(a[:, 2 * L:] - b[:, 2 * L:]).max()) > 0
