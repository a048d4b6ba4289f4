"""Layer stacks: scan, remat and unrolled loops give the plain stack's gradients; the
reversible custom VJP gives autodiff's gradients; parameter sharing ties layers."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import xformers_jax.nn as nn
from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax.nn._stack import _branches

D, L = 32, 16


def _stack(key, **kw):
    return nn.LayerStack(lambda k: nn.TransformerBlock(D, 4, 64, max_len=L, key=k), 2,
                         key=key, **kw)


def _grads(stack, x, mask):
    return eqx.filter_jit(eqx.filter_grad(
        lambda s, x: jnp.sum(jnp.sin(s(x, kv_mask=mask))), ))(stack, x)


@pytest.fixture
def inputs():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, L, D))
    mask = jnp.arange(L)[None] < jnp.array([[L], [10]])
    return x, mask


@pytest.mark.parametrize("setting", [dict(scan=True), dict(remat="full"),
                                     dict(remat="dots_saveable"),
                                     dict(remat="full", scan=False)])
def test_scan_and_remat_match_the_plain_stack(setting, inputs):
    x, mask = inputs
    key = jax.random.PRNGKey(0)
    plain = _stack(key, scan=False)
    other = _stack(key, **setting)
    g_plain, g_other = _grads(plain, x, mask), _grads(other, x, mask)
    for a, b in zip(jax.tree_util.tree_leaves(g_plain), jax.tree_util.tree_leaves(g_other)):
        assert_close(b, a, EXACT_GRAD)


def test_reversible_custom_vjp_matches_autodiff(inputs):
    x, mask = inputs
    stack = _stack(jax.random.PRNGKey(0), reversible=True)
    dynamic, static = stack.per_layer()

    def reference(dynamic, x):
        # The same RevNet recurrence, differentiated by ordinary autodiff.
        a = b = x
        for i in range(stack.num_layers):
            f, g = _branches(static, jax.tree_util.tree_map(lambda p: p[i], dynamic), mask)
            a = a + f(b)
            b = b + g(a)
        return jnp.sum(jnp.sin((a + b) / 2))

    def custom(stack, x):
        return jnp.sum(jnp.sin(stack(x, kv_mask=mask)))

    assert_close(eqx.filter_jit(custom)(stack, x), jax.jit(reference)(dynamic, x))
    g_ref, gx_ref = jax.jit(jax.grad(reference, argnums=(0, 1)))(dynamic, x)
    g_cus, gx_cus = eqx.filter_jit(eqx.filter_grad(lambda sx: custom(*sx)))((stack, x))
    assert_close(gx_cus, gx_ref, EXACT_GRAD)
    g_cus_dyn = eqx.filter(g_cus, eqx.is_array)
    for a, b in zip(jax.tree_util.tree_leaves(g_ref), jax.tree_util.tree_leaves(g_cus_dyn)):
        assert_close(b, a, EXACT_GRAD)


def test_reversible_rejects_post_norm_blocks():
    with pytest.raises(ValueError, match="reversible=True needs pre-norm blocks"):
        nn.LayerStack(lambda k: nn.TransformerBlock(D, 4, 64, placement="post", key=k), 2,
                      reversible=True, key=jax.random.PRNGKey(0))


def test_albert_sharing(inputs):
    x, mask = inputs
    shared = _stack(jax.random.PRNGKey(0), sharing="all")
    assert shared.layers.attn.wq.shape[0] == 1
    # ALBERT with one shared block equals applying that block twice.
    block = jax.tree_util.tree_map(lambda a: a[0], shared.layers)
    y = block(block(x, kv_mask=mask), kv_mask=mask)
    assert_close(shared(x, kv_mask=mask), y)
    att = _stack(jax.random.PRNGKey(0), sharing="attention")
    dyn, _ = att.per_layer()
    assert bool(jnp.all(dyn.attn.wq[0] == dyn.attn.wq[1]))
    assert not bool(jnp.all(dyn.ffn.w1[0] == dyn.ffn.w1[1]))
    g = eqx.filter_grad(lambda s: jnp.sum(s(x, kv_mask=mask)))(att)
    assert g.layers.attn.wq.shape[0] == 2  # only layer 0's copy is used and gets gradients
    assert float(jnp.abs(g.layers.attn.wq[1]).sum()) == 0.0


def test_universal_transformer_recurrence(inputs):
    x, mask = inputs
    ut = _stack(jax.random.PRNGKey(0), universal=True)
    assert ut.sharing == "all" and ut.layers.attn.wq.shape[0] == 1
    plain_shared = _stack(jax.random.PRNGKey(0), sharing="all")
    # The timestep embedding makes it differ from plain weight sharing.
    assert not jnp.allclose(ut(x, kv_mask=mask), plain_shared(x, kv_mask=mask))


def test_bad_settings():
    with pytest.raises(ValueError, match="remat must be one of"):
        _stack(jax.random.PRNGKey(0), remat="some")
    with pytest.raises(ValueError, match="sharing must be one of"):
        _stack(jax.random.PRNGKey(0), sharing="some")
    with pytest.raises(ValueError, match="stateful norms"):
        nn.LayerStack(lambda k: nn.TransformerBlock(D, 4, 64, norm="power", key=k), 2,
                      key=jax.random.PRNGKey(0))
