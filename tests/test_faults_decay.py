"""Weight decay by declared role, and fixed buffers kept out of the optimizer (the project's
own optimizer at the LRA ListOps Performer settings)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from xformers_jax import axes, nn, train
from xformers_jax_experiments.configs.lra import listops

_TASK = train.Task(None, None, None, vocab_size=20, num_classes=10, seq_len=16, padded=True)


def _performer():
    """The listops.py:performer config (LRA optimizer settings: AdamW, lr 5e-2, weight decay
    0.1, rsqrt with 1000 warm-up steps) at a tiny width, and its scanned 2-layer model."""
    c = listops.get_config("performer")
    with c.unlocked():
        c.model.update(dict(dim=16, num_layers=2, num_heads=2, hidden=32))
    return c, train.build_model(c.model, _TASK, jax.random.PRNGKey(0))


def _optimizer(c):
    o = c.optim
    schedule = train.make_schedule(o.schedule, learning_rate=o.learning_rate,
                                   warmup_steps=o.warmup_steps, total_steps=c.num_train_steps)
    return train.make_optimizer(schedule, weight_decay=o.weight_decay,
                                grad_clip_norm=o.grad_clip_norm, b1=o.b1, b2=o.b2)


def _paths(tree):
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_which_leaves_decay_in_a_scanned_performer():
    c, model = _performer()
    decayed = _paths(axes.decayed(model))
    assert sorted(k for k, v in decayed.items() if v) == sorted([
        ".encoder.embed.table", ".head",
        *(f".encoder.layers.layers.attn.{w}" for w in ("wq", "wk", "wv", "wo")),
        ".encoder.layers.layers.ffn.w1", ".encoder.layers.layers.ffn.w2"])
    # Everything else: biases, the stacked norms' scales and biases, the residual gains, the
    # final norm, and the random projection (a buffer, not a parameter at all).
    assert {k for k, v in _paths(axes.fixed_buffers(model)).items() if v} == {
        ".encoder.layers.layers.attn.variant_params.value"}
    assert train.trainable(model).encoder.layers.layers.attn.variant_params.value is None
    # A declared position table is not decayed, nor are ALiBi's fixed slopes.
    table = nn.LearnedPositions(8, 4, key=jax.random.PRNGKey(0))
    assert _paths(axes.decayed(table)) == {".table": False}
    assert _paths(axes.fixed_buffers(nn.ALiBi(2))) == {".slopes.value": True}


def test_zero_and_random_gradients_leave_projection_and_norms_unchanged():
    c, model = _performer()
    optimizer = _optimizer(c)
    params = lambda m: {k: np.asarray(v) for k, v in  # noqa: E731
                        _paths(eqx.filter(m, eqx.is_array)).items()}
    copy = lambda m: jax.tree.map(jnp.array, m)  # noqa: E731  (a step donates its state)
    before = params(model)
    projection = ".encoder.layers.layers.attn.variant_params.value"
    fixed = [k for k in before if k == projection or ".norms" in k or "final_norm" in k
             or k.endswith((".b1", ".b2", ".gains"))]
    weights = [k for k, v in _paths(axes.decayed(model)).items() if v]
    assert len(fixed) == 10 and len(weights) == 8

    def zero_loss(m, batch, key):  # every trainable parameter's gradient is exactly zero
        return sum(0.0 * jnp.sum(x) for x in jax.tree.leaves(train.trainable(m))), {}

    state = train.create_train_state(copy(model), optimizer, jax.random.PRNGKey(1))
    step = train.make_train_step(zero_loss, optimizer)
    for _ in range(30):
        state, metrics = step(state, {})
    after = params(state.model)
    for k in fixed:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    for k in weights:  # decoupled weight decay shrinks every weight
        assert np.linalg.norm(after[k]) < np.linalg.norm(before[k]), k

    noise = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(2), x.shape),
                         train.trainable(model))

    def random_loss(m, batch, key):  # random gradients, and a loss that reads the projection
        g = sum(jnp.vdot(n, x) for n, x in zip(jax.tree.leaves(noise),
                                               jax.tree.leaves(train.trainable(m))))
        attn = m.encoder.layers.layers.attn
        return g + jnp.sum(attn.variant_params.value ** 2), {}

    state = train.create_train_state(copy(model), optimizer, jax.random.PRNGKey(1))
    step = train.make_train_step(random_loss, optimizer)
    norms = []
    for _ in range(5):
        state, metrics = step(state, {})
        norms.append(float(metrics["grad_norm"]))
    np.testing.assert_array_equal(params(state.model)[projection], before[projection])
    # The gradient norm is the random gradients' alone: the projection has none.
    expected = float(jnp.sqrt(sum(jnp.sum(n ** 2) for n in jax.tree.leaves(noise))))
    np.testing.assert_allclose(norms, expected, rtol=1e-5)
    assert not np.array_equal(params(state.model)[".head"], before[".head"])
