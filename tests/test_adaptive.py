"""Adaptive depth: ACT (reference from Graves's / the Universal Transformer's equations, halt
after one step = one layer, decoding = parallel form, no leak, padding), early exit (exits
consistent with the DeeBERT / PABEE criteria, the layers after the batch's last exit are not
run) and LayerDrop (a dropped layer is skipped, not multiplied by zero)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xformers_jax.models as models
import xformers_jax.nn as nn
from xformers_jax.nn._positions import sinusoid
from tests.fast_jit import build
from tests.tolerances import EXACT_GRAD, assert_close

B, L, DIM, HEADS, HIDDEN, STEPS = 2, 8, 16, 2, 32, 3
jit0 = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


@functools.lru_cache(maxsize=None)
def _act(causal=False, halt_bias=0.0, threshold=0.99):
    make = lambda k: nn.TransformerBlock(DIM, HEADS, HIDDEN, causal=causal, max_len=L,  # noqa
                                         key=k)
    return build(functools.partial(models.ACTStack, make, DIM, STEPS, threshold=threshold,
                                   halt_bias=halt_bias), 0)


# Forward calls compiled as one program each (eager calls compile every operation).
_fwd = eqx.filter_jit(lambda m, x, **kw: m(x, **kw))


def _x(seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, L, DIM))


def _act_reference(model, x, mask=None):
    """Graves (2016) per position, written as the sum over steps: N = the first step where the
    accumulated halting probability passes the threshold (or the last), p_N replaced by the
    remainder R = 1 - sum_{n<N} p_n, output sum_n p_n s_n."""
    states, ps, s = [], [], x
    for t in range(STEPS):
        s = s + sinusoid(jnp.asarray(t), DIM)
        ps.append(jax.nn.sigmoid(s @ model.halt_w + model.halt_b))
        s = model.block(s, kv_mask=mask)
        states.append(s)
    ps = jnp.stack(ps)                                  # [T, B, L]
    cum = jnp.cumsum(ps, axis=0)
    passed = (cum > model.threshold).at[-1].set(True)
    n = jnp.argmax(passed, axis=0)                      # N - 1, per position
    before = jnp.where(jnp.arange(STEPS)[:, None, None] < n, ps, 0.0)
    rem = 1.0 - before.sum(0)
    w = before + jnp.where(jnp.arange(STEPS)[:, None, None] == n, rem, 0.0)
    out = jnp.einsum("tbl,tbld->bld", w, jnp.stack(states))
    return out, (n + 1).astype(jnp.float32), rem


def test_act_matches_graves_reference_outputs_and_gradients():
    model, x = _act(halt_bias=-0.5, threshold=0.7), _x()
    out, info = eqx.filter_jit(model)(x)
    ref, n, rem = eqx.filter_jit(_act_reference)(model, x)
    assert_close(out, ref)
    np.testing.assert_array_equal(np.asarray(info.updates), np.asarray(n))
    assert_close(info.remainders, rem)
    assert len(np.unique(np.asarray(n))) > 1, "test needs positions halting at different steps"

    def loss(f):
        return lambda m: jnp.sum(jnp.sin(f(m)))

    params, static = eqx.partition(model, eqx.is_inexact_array)
    g = jit0(jax.grad(lambda p: loss(lambda m: m(x)[0])(eqx.combine(p, static))))(params)
    gr = jit0(jax.grad(lambda p: loss(lambda m: _act_reference(m, x)[0])(
        eqx.combine(p, static))))(params)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(gr)):
        assert_close(a, b, EXACT_GRAD)


def test_act_that_always_halts_after_one_step_is_one_layer():
    model, x = _act(halt_bias=30.0), _x()
    out, info = _fwd(model, x)
    one = _fwd(model.block, x + sinusoid(jnp.asarray(0), DIM))
    assert_close(out, one)
    np.testing.assert_array_equal(np.asarray(info.updates), 1.0)
    # The same as a one-layer Universal-Transformer stack of that block.
    stack = nn.LayerStack(lambda k: model.block, 1, universal=True, key=jax.random.PRNGKey(3))
    assert_close(out, _fwd(stack, x))


def test_act_decodes_step_by_step_as_the_parallel_form_and_leaks_nothing():
    model, x = _act(causal=True, halt_bias=-0.5, threshold=0.7), _x(2)
    par, _ = _fwd(model, x)
    caches = model.init_cache(B, L)
    step = eqx.filter_jit(lambda x, c: model.decode(x, c))
    outs = []
    for t in range(L):
        y, caches = step(x[:, t:t + 1], caches)
        outs.append(y)
    assert_close(jnp.concatenate(outs, axis=1), par)
    t = L // 2
    moved, _ = _fwd(model, x.at[:, t].add(1.0))
    np.testing.assert_allclose(np.asarray(moved[:, :t]), np.asarray(par[:, :t]), atol=1e-6)
    assert float(jnp.abs(moved[:, t:] - par[:, t:]).max()) > 1e-3


class _Counting(eqx.Module):
    """The block, counting the times it is computed (a host callback runs only when the
    branch holding it does)."""

    block: eqx.Module

    def __call__(self, x, *, kv_mask=None, key=None):
        jax.debug.callback(lambda: _CALLS.append(1))
        return self.block(x, kv_mask=kv_mask, key=key)


_CALLS = []


@pytest.mark.parametrize("halt_bias,threshold,slowest", [(30.0, 0.99, 1), (2.5, 0.7, 2)])
def test_act_skips_the_steps_after_every_position_halted(halt_bias, threshold, slowest):
    model, x = _act(halt_bias=halt_bias, threshold=threshold), _x()
    counted = eqx.tree_at(lambda m: m.block, model, _Counting(model.block))
    _CALLS.clear()
    out, info = eqx.filter_jit(lambda m, x: m(x))(counted, x)
    jax.effects_barrier()
    # Positions halting after 1 (and 2) of 3 steps: the block runs only as often as the
    # slowest position needs.
    assert int(np.asarray(info.updates).max()) == slowest < STEPS
    assert int(info.steps_run) == slowest == len(_CALLS)
    ref, n, _ = eqx.filter_jit(_act_reference)(model, x)   # every step computed
    assert_close(out, ref)


def test_act_padding_changes_no_real_output():
    model, x = _act(halt_bias=-0.5, threshold=0.7), _x(3)
    n = L - 3
    mask = jnp.arange(L)[None].repeat(B, 0) < n
    junk = x.at[:, n:].set(7.0)
    a, info = _fwd(model, x, kv_mask=mask)
    b, _ = _fwd(model, junk, kv_mask=mask)
    c, _ = _fwd(model, x[:, :n])
    assert_close(a[:, :n], b[:, :n])
    assert_close(a[:, :n], c)
    with pytest.raises(ValueError, match="max_steps must be a positive int"):
        models.ACTStack(lambda k: None, DIM, 0, key=jax.random.PRNGKey(0))


# --- early exit ---------------------------------------------------------------------------------

NL = 3


@functools.lru_cache(maxsize=None)
def _exit_model():
    m = build(functools.partial(models.EarlyExitClassifier, 4, DIM, NL, HEADS, HIDDEN,
                                vocab_size=20, max_len=L), 4)
    # Larger exit weights than at initialisation: confident, varied predictions to exit on.
    return eqx.tree_at(lambda m: m.heads, m, m.heads * 6)


def _tokens():
    return jax.random.randint(jax.random.PRNGKey(5), (6, L), 0, 20)


@eqx.filter_jit
def _run_exit(model, tokens, mask, criterion, arg):
    kw = {"threshold": arg} if criterion == "entropy" else {"patience": arg}
    return model.exit(tokens, mask=mask, criterion=criterion, **kw)


@pytest.mark.parametrize("criterion,arg", [("entropy", 0.3), ("entropy", 0.7),
                                           ("patience", 1), ("patience", 2)])
def test_early_exit_is_consistent_with_the_thresholds(criterion, arg):
    model, tokens = _exit_model(), _tokens()
    mask = jnp.arange(L)[None] < jnp.array([[L], [L], [L - 2], [L], [L - 4], [L]])
    every = _fwd(model, tokens, mask=mask)                 # [NL, B, C]
    logp = jax.nn.log_softmax(every, -1)
    entropy = -(jnp.exp(logp) * logp).sum(-1)              # [NL, B]
    if criterion == "entropy":                              # thresholds at the 30%, 70% points
        arg = float(np.quantile(np.asarray(entropy), arg))
    preds = np.asarray(jnp.argmax(every, -1))
    want = []
    for b in range(tokens.shape[0]):
        layer, count = NL, 0
        for i in range(NL):
            if criterion == "entropy":
                hit = float(entropy[i, b]) < arg
            else:
                count = count + 1 if i > 0 and preds[i, b] == preds[i - 1, b] else 0
                hit = count >= arg
            if hit:
                layer = i + 1
                break
        want.append(layer)
    res = _run_exit(model, tokens, mask, criterion, jnp.asarray(arg))
    np.testing.assert_array_equal(np.asarray(res.exit_layer), want)
    assert_close(res.logits, every[np.asarray(want) - 1, np.arange(len(want))])
    assert int(res.layers_run) == max(want)
    np.testing.assert_allclose(float(res.expected_layers), np.mean(want))
    np.testing.assert_allclose(float(res.flops_saved), 1 - np.mean(want) / NL, atol=1e-6)


def test_early_exit_skips_the_layers_after_the_last_exit():
    model, tokens = _exit_model(), _tokens()
    # Poison every layer after the first: a layer that ran (even multiplied by zero) would
    # make the logits NaN.
    poisoned = eqx.tree_at(lambda m: m.encoder.layers.layers.ffn,
                           model, jax.tree_util.tree_map(
                               lambda a: a.at[1:].set(jnp.nan) if eqx.is_inexact_array(a) else a,
                               model.encoder.layers.layers.ffn))
    res = _run_exit(poisoned, tokens, None, "entropy", jnp.asarray(100.0))
    assert int(res.layers_run) == 1
    assert bool(jnp.isfinite(res.logits).all())
    np.testing.assert_allclose(float(res.flops_saved), 1 - 1 / NL, atol=1e-6)
    with pytest.raises(ValueError, match="criterion must be one of"):
        model.exit(tokens, criterion="margin")


def test_early_exit_loss_weights_the_exits():
    logits = jax.random.normal(jax.random.PRNGKey(6), (NL, 4, 5))
    labels = jnp.array([0, 1, 2, 3])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[None, :, None], -1)[..., 0]
    per = nll.mean(1)
    np.testing.assert_allclose(models.early_exit_loss(logits, labels),
                               (per * jnp.arange(1, NL + 1)).sum() / 6, rtol=1e-6)
    np.testing.assert_allclose(models.early_exit_loss(logits, labels, weighting="mean"),
                               per.mean(), rtol=1e-6)


# --- LayerDrop (Fan et al., 2020) ---------------------------------------------------------------

def _drop_stack(rate):
    make = lambda k: nn.TransformerBlock(DIM, HEADS, HIDDEN, max_len=L, key=k)  # noqa: E731
    return build(functools.partial(nn.LayerStack, make, 4, layerdrop=rate), 7)


def test_layerdrop_skips_dropped_layers_and_prunes():
    stack, x = _drop_stack(0.5), _x(8)
    drops = eqx.filter_jit(lambda s, k: s.dropped_layers(k))
    key = next(k for k in (jax.random.PRNGKey(i) for i in range(50))
               if 0 < int(drops(stack, k).sum()) < 4)
    dropped = np.asarray(drops(stack, key))
    run = eqx.filter_jit(lambda s, x, k: s(x, key=k))
    out = run(stack, x, key)
    # The same as running only the kept layers.
    kept = stack.prune(np.flatnonzero(~dropped))
    assert kept.num_layers == int((~dropped).sum())
    assert_close(out, _fwd(kept, x))
    # A dropped layer is not computed: NaN parameters in it leave the output finite (a layer
    # multiplied by zero would give NaN), and in a kept layer they do not.
    poison = lambda which: eqx.tree_at(  # noqa: E731
        lambda s: s.layers.ffn, stack, jax.tree_util.tree_map(
            lambda a: a.at[which].set(jnp.nan) if eqx.is_inexact_array(a) else a,
            stack.layers.ffn))
    assert bool(jnp.isfinite(run(poison(int(np.flatnonzero(dropped)[0])), x, key)).all())
    assert not bool(jnp.isfinite(run(poison(int(np.flatnonzero(~dropped)[0])), x, key)).all())
    # Gradients flow through the kept layers only.
    params, static = eqx.partition(stack, eqx.is_inexact_array)
    g = jax.grad(lambda p: jnp.sum(run(eqx.combine(p, static), x, key) ** 2))(params)
    per_layer = np.asarray(jnp.abs(g.layers.ffn.w1).sum(axis=(1, 2)))
    np.testing.assert_array_equal(per_layer == 0, dropped)
    # No key or inference: every layer runs.
    assert_close(_fwd(stack, x), _fwd(_drop_stack(0.0), x))
    with pytest.raises(ValueError, match="layerdrop must be in"):
        _drop_stack(1.0)
    with pytest.raises(ValueError, match="keep must be layer indices"):
        stack.prune([4])
