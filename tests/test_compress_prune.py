"""Pruning: Zhu & Gupta's schedule and magnitude masks against references, pruned weights
staying zero through training and a checkpoint resume, lottery-ticket rewinding, head
importance against explicit head gates, and layer dropping."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests._compress_model import small_classifier
from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import compress as C
from xformers_jax import parallel, train


def test_gradual_sparsity_matches_zhu_gupta():
    final, init, t0, n, dt = 0.8, 0.1, 10, 5, 4

    def ref(t):
        if t < t0:
            return init
        last = t0 + min((t - t0) // dt, n) * dt
        return final + (init - final) * (1 - (last - t0) / (n * dt)) ** 3

    steps = np.arange(0, 45)
    got = jax.vmap(lambda t: C.gradual_sparsity(t, final, initial=init, begin=t0,
                                                end=t0 + n * dt, frequency=dt))(steps)
    np.testing.assert_allclose(got, [ref(t) for t in steps], rtol=1e-6)
    assert float(got[-1]) == pytest.approx(final)
    with pytest.raises(ValueError, match="initial <= final"):
        C.gradual_sparsity(0, 0.2, initial=0.5)


class _Net(eqx.Module):
    w1: jax.Array
    w2: jax.Array
    b: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.w1.astype(x.dtype) + self.b) @ self.w2.astype(x.dtype)


def _net(seed=0, stacked=False):
    r = np.random.default_rng(seed)
    shape1 = (3, 6, 8) if stacked else (6, 8)
    return _Net(jnp.asarray(r.normal(size=shape1), jnp.float32),
                jnp.asarray(r.normal(size=(8, 2)), jnp.float32), jnp.zeros((8,)))


def _np_keep(mag, s):
    flat = mag.reshape(-1)
    k = int(np.floor(s * flat.size))
    order = np.argsort(flat, kind="stable")
    keep = np.ones(flat.size, bool)
    keep[order[:k]] = False
    return keep.reshape(mag.shape)


def test_magnitude_masks_layer_and_global_match_numpy():
    m = _net(1, stacked=True)
    masks = C.magnitude_masks(m, 0.5, scope="layer")
    w1, w2 = np.abs(np.asarray(m.w1)), np.abs(np.asarray(m.w2))
    for i in range(3):  # each stacked layer pruned on its own
        np.testing.assert_array_equal(masks.w1[i], _np_keep(w1[i], 0.5))
    np.testing.assert_array_equal(masks.w2, _np_keep(w2, 0.5))
    assert bool(masks.b.all())  # not a matrix: never pruned
    g = C.magnitude_masks(m, 0.7, scope="global")
    pooled = _np_keep(np.concatenate([w1.reshape(-1), w2.reshape(-1)]), 0.7)
    np.testing.assert_array_equal(np.concatenate([np.asarray(g.w1).reshape(-1),
                                                  np.asarray(g.w2).reshape(-1)]), pooled)
    report = C.sparsity_report(C.apply_masks(m, masks))
    assert report[".w1"] == [0.5, 0.5, 0.5] and report[".w2"] == 0.5
    with pytest.raises(ValueError, match="scope"):
        C.magnitude_masks(m, 0.5, scope="row")


def _loss(model, batch, key):
    y = model(batch["x"])
    return jnp.mean((y - batch["y"]) ** 2), {}


def _batches(n):
    r = np.random.default_rng(7)
    return [{"x": jnp.asarray(r.normal(size=(4, 6)), jnp.float32),
             "y": jnp.asarray(r.normal(size=(4, 2)), jnp.float32)} for _ in range(n)]


def test_pruned_weights_stay_zero_through_training_and_resume(tmp_path):
    schedule = functools.partial(C.gradual_sparsity, final=0.5, begin=0, end=4, frequency=2)
    opt = C.prune_transform(optax.adam(3e-2), schedule=schedule)
    step = train.make_train_step(_loss, opt)
    fresh = lambda: train.create_train_state(_net(2, stacked=True), opt,  # noqa: E731
                                             jax.random.PRNGKey(0))
    batches = _batches(8)

    def check(state):
        masks = C.masks_of(state.opt_state)
        for w, mk in ((state.model.w1, masks.w1), (state.model.w2, masks.w2)):
            assert bool(jnp.all(jnp.where(mk, True, w == 0)))
        return masks

    state = fresh()
    for b in batches[:3]:
        state, _ = step(state, b)
        check(state)
    parallel.save_checkpoint(str(tmp_path / "ck"), state)
    resumed = parallel.restore_checkpoint(str(tmp_path / "ck"), fresh())
    assert int(resumed.step) == 3
    np.testing.assert_array_equal(C.masks_of(resumed.opt_state).w1,
                                  C.masks_of(state.opt_state).w1)
    masks3 = np.asarray(C.masks_of(state.opt_state).w1)
    uninterrupted = state  # the step donates its input: only the returned states are used
    for b in batches[3:]:
        resumed, _ = step(resumed, b)
        uninterrupted, _ = step(uninterrupted, b)
        masks = check(resumed)
    # a resumed run is the run that never stopped, and it reached the final sparsity
    np.testing.assert_array_equal(resumed.model.w1, uninterrupted.model.w1)
    report = C.sparsity_report(resumed.model)
    assert report[".w1"] == [0.5, 0.5, 0.5] and report[".w2"] == 0.5
    # masks only shrink: what was pruned at step 3 is still pruned
    assert bool(np.all(masks3 | ~np.asarray(masks.w1)))


def test_lottery_ticket_rewinds_to_saved_weights():
    early, trained = _net(3), _net(4)
    rewound, masks = C.lottery_ticket(trained, early, 0.6)
    np.testing.assert_array_equal(masks.w1, _np_keep(np.abs(np.asarray(trained.w1)), 0.6))
    np.testing.assert_array_equal(rewound.w1, np.where(masks.w1, early.w1, 0.0))
    np.testing.assert_array_equal(rewound.w2, np.where(masks.w2, early.w2, 0.0))
    np.testing.assert_array_equal(rewound.b, early.b)
    # retraining under the ticket's fixed masks keeps the pruned weights at zero
    opt = C.prune_transform(optax.sgd(0.1), masks=masks)
    state = train.create_train_state(jax.tree.map(jnp.array, rewound), opt,
                                     jax.random.PRNGKey(0))
    state, _ = train.make_train_step(_loss, opt)(state, _batches(1)[0])
    assert bool(jnp.all(jnp.where(masks.w1, True, state.model.w1 == 0)))
    assert not np.array_equal(state.model.w1, rewound.w1)


@pytest.fixture(scope="module")
def encoder():
    m = small_classifier()
    x = jax.random.randint(jax.random.PRNGKey(1), (4, 8), 1, 10)
    y = jnp.asarray([0, 1, 2, 1])
    return m, {"x": x, "y": y}


def _ce(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def test_head_importance_equals_gate_gradients_and_pruned_heads_are_silent(encoder):
    m, data = encoder
    imp = C.head_importance(m, _ce, data, normalize=False)
    key = ".encoder.layers.layers.attn.wo"
    assert imp[key].shape == (2, 2)
    # reference: a gate xi[layer, head] multiplying each head's output, per example
    wo = m.encoder.layers.layers.attn.wo  # [layers, heads * head_dim, dim]

    def gated(xi, ex):
        scale = jnp.repeat(xi, wo.shape[1] // 2, axis=1)[..., None]
        mm = eqx.tree_at(lambda t: t.encoder.layers.layers.attn.wo, m, wo * scale)
        return _ce(mm, jax.tree.map(lambda a: a[None], ex))

    per = jax.jit(jax.vmap(jax.grad(gated), in_axes=(None, 0)))(jnp.ones((2, 2)), data)
    assert_close(imp[key], jnp.abs(per).mean(0), EXACT_GRAD)

    masks, kept = C.head_masks(m, C.head_importance(m, _ce, data), 0.25)
    assert int(kept[key].sum()) == 3  # one of four heads pruned
    pruned = C.apply_masks(m, masks)
    layer, head = [int(i) for i in np.argwhere(~np.asarray(kept[key]))[0]]
    # the pruned head's queries no longer matter
    hd = wo.shape[1] // 2
    wq = pruned.encoder.layers.layers.attn.wq
    noisy = eqx.tree_at(lambda t: t.encoder.layers.layers.attn.wq, pruned,
                        wq.at[layer, :, head * hd:(head + 1) * hd].add(1.0))
    run = eqx.filter_jit(lambda mm: mm(data["x"]))
    np.testing.assert_allclose(run(noisy), run(pruned), atol=1e-6)
    with pytest.raises(ValueError, match="fraction"):
        C.head_masks(m, imp, 1.0)


def test_drop_layers_keeps_the_chosen_blocks(encoder):
    m, data = encoder
    one = C.drop_layers(m, [1])
    assert one.encoder.layers.num_layers == 1
    # reference: embed, layer 1 alone, final norm, CLS pooling, head

    @eqx.filter_jit
    def reference(m):
        x, mask = m.encoder.embed(data["x"])
        dynamic, static = m.encoder.layers.per_layer()
        block = eqx.combine(jax.tree.map(lambda a: a[1], dynamic), static)
        h = m.encoder.final_norm(block(x, kv_mask=mask))
        return h[:, 0] @ m.head

    assert_close(eqx.filter_jit(lambda mm: mm(data["x"]))(one), reference(m))
    with pytest.raises(ValueError, match="out of range"):
        C.drop_layers(m, [2])
