"""DeLighT: the group linear transformations, shuffling and input mixer against a numpy
reference of the DeLighT transformation's equations; the expand-reduce widths and groups;
block-wise scaling (eq. 4); the stack's causal no-leak, padding invariance, gradients and bf16."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xformers_jax.models import DeLighTStack, DeLighTTransform, GroupLinear, delight_scaling
from xformers_jax.models._delight import delight_widths
from tests.fast_jit import build, jit0
from tests.tolerances import assert_close

B, L, DIM = 2, 8, 16


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _transform_ref(x, t):
    """Y^1 = F(X), Y^l = F(H(X, Y^(l-1))), F a group linear map, H the group-wise concat, a
    GELU and a feature shuffle between layers."""
    x = np.asarray(x, np.float64)
    y = None
    for i, layer in enumerate(t.layers):
        g = layer.groups
        if i == 0:
            inp = x
        else:
            xs, ys = np.split(x, g, -1), np.split(y, g, -1)
            inp = np.concatenate([np.concatenate([a, b], -1) for a, b in zip(xs, ys)], -1)
        parts = np.split(inp, g, -1)
        w = np.asarray(layer.weight, np.float64)
        out = np.concatenate([parts[j] @ w[j] for j in range(g)], -1) + np.asarray(layer.bias)
        if i < len(t.layers) - 1:
            out = _gelu(out)
            n = out.shape[-1] // g
            # channel j of group i moves to position j * g + i
            shuffled = np.empty_like(out)
            for gi in range(g):
                for j in range(n):
                    shuffled[..., j * g + gi] = out[..., gi * n + j]
            out = shuffled
        y = out
    return y


def test_widths_groups_and_scaling():
    assert delight_widths(16, 8, 4, 2.0, 4) == ([24, 32, 20, 8], [1, 2, 2, 1])
    assert delight_widths(16, 8, 5, 2.0, 4)[1] == [1, 2, 4, 2, 1]
    # N^b = N_min + (N_max - N_min) b / (B - 1), w^b = w_m + (N_max - N_min) b / (N_min (B - 1))
    assert delight_scaling(4, 2, 8, 2.0) == [(2, 2.0), (4, 3.0), (6, 4.0), (8, 5.0)]
    # Fractional depths (the paper's N_min = 4, N_max = 8 over B = 8 blocks): eq. 4 gives
    # 4, 4.57, 5.14, 5.71, 6.29, 6.86, 7.43, 8, of which the integer part is taken.
    scaled = delight_scaling(8, 4, 8, 2.0)
    assert [n for n, _ in scaled] == [4, 4, 5, 5, 6, 6, 7, 8]
    np.testing.assert_allclose([w for _, w in scaled], [2.0 + 4 * b / (4 * 7) for b in range(8)])
    assert scaled[-1][1] == pytest.approx(2.0 + 8 / 4 - 1)  # w_m + N_max / N_min - 1
    with pytest.raises(ValueError, match="min_depth"):
        delight_scaling(3, 4, 2, 2.0)
    with pytest.raises(ValueError, match="divisible by groups"):
        GroupLinear(6, 8, 4, key=jax.random.PRNGKey(0))


def test_transform_matches_equations():
    t = build(functools.partial(DeLighTTransform, DIM, DIM // 2, depth=4, width_mult=2.0,
                                max_groups=4), 4)
    t = jax.tree_util.tree_map(lambda a: a + 0.1 * np.cos(np.arange(a.size).reshape(a.shape))
                               if eqx.is_inexact_array(a) else a, t)
    x = np.random.default_rng(1).standard_normal((5, DIM)).astype(np.float32)
    assert_close(jit0(lambda t, x: t(x))(t, x), _transform_ref(x, t))
    assert len(t.layers) == 4 and t.widths[-1] == DIM // 2


@pytest.fixture(scope="module")
def stack():
    return build(functools.partial(DeLighTStack, DIM, 2, min_depth=2, max_depth=4,
                                   width_mult=2.0, causal=True, max_len=L), 3)


def test_stack_scaling_causal_padding_grads_bf16(stack):
    assert [len(b.transform.layers) for b in stack.blocks] == [2, 4]
    assert stack.scaling == ((2, 2.0), (4, 3.0))
    run = jit0(lambda m, x, mask: m(x, kv_mask=mask))
    x = jax.random.normal(jax.random.PRNGKey(4), (B, L, DIM))
    full = jnp.ones((B, L), bool)
    y = run(stack, x, full)
    t = L // 2
    # (Not a constant shift: the LayerNorms would remove it.)
    moved = run(stack, x.at[:, t].add(jnp.linspace(-1.0, 1.0, DIM)), full)
    np.testing.assert_allclose(np.asarray(moved[:, :t]), np.asarray(y[:, :t]), atol=1e-6)
    assert float(jnp.abs(moved[:, t:] - y[:, t:]).max()) > 1e-3
    # Padding at the end changes no real output (causal: the real prefix is the same run).
    mask = jnp.arange(L)[None] < jnp.array([[L], [L - 3]])
    junk = run(stack, x.at[1, L - 3:].set(7.0), mask)
    assert_close(junk[0], y[0])
    assert_close(junk[1, :L - 3], y[1, :L - 3])
    grads = jit0(jax.grad(lambda m: jnp.sum(m(x, kv_mask=full) ** 2)))(stack)
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert float(jnp.abs(grads.blocks[0].transform.layers[0].weight).max()) > 0
    yb = run(jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16)
                                    if eqx.is_inexact_array(a) else a, stack),
             x.astype(jnp.bfloat16), full)
    assert yb.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(yb.astype(jnp.float32))))
