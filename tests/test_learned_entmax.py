"""sparsemax, 1.5-entmax, alpha-entmax (bisection), entmax attention and top-k attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import assert_close
from xformers_jax.attention import (
    dot_product_attention, entmax15, entmax_alpha, entmax_attention, entmax_bisect, sparsemax,
    topk_attention,
)

L, D = 32, 16

# Jitted: op-by-op execution of the sorts and bisection loops dominates these small tests.
sparsemax = jax.jit(sparsemax)
entmax15 = jax.jit(entmax15)
entmax_bisect = jax.jit(entmax_bisect, static_argnames=("n_iter",))
entmax_attention = jax.jit(entmax_attention, static_argnames=("alpha", "causal"))
topk_attention = jax.jit(topk_attention, static_argnames=("top_k", "causal"))
dot_product_attention = jax.jit(dot_product_attention, static_argnames=("causal",))


def _np_sparsemax(z):
    zs = np.sort(z)[::-1]
    k = np.arange(1, len(z) + 1)
    cs = np.cumsum(zs)
    kz = k[1 + k * zs > cs].max()
    return np.maximum(z - (cs[kz - 1] - 1) / kz, 0)


def _np_entmax_bisect(z, alpha, iters=200):
    """alpha-entmax by float64 bisection on tau (Eq 18)."""
    x = (alpha - 1) * np.asarray(z, np.float64)
    lo, hi = x.max() - 1, x.max()
    for _ in range(iters):
        mid = (lo + hi) / 2
        if (np.maximum(x - mid, 0) ** (1 / (alpha - 1))).sum() >= 1:
            lo = mid
        else:
            hi = mid
    return np.maximum(x - lo, 0) ** (1 / (alpha - 1))


MAPS = {
    "sparsemax": (sparsemax, 2.0),
    "entmax15": (entmax15, 1.5),
    "bisect13": (lambda z, m=None: entmax_bisect(z, 1.3, m), 1.3),
}


@pytest.mark.parametrize("name", list(MAPS))
def test_on_simplex_with_exact_zeros_and_reference(name):
    fn, alpha = MAPS[name]
    z = 2.0 * jax.random.normal(jax.random.PRNGKey(0), (6, 20))
    p = np.asarray(fn(z))
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
    assert (p >= 0).all() and (p == 0).any(axis=-1).all()
    for row, zr in zip(p, np.asarray(z)):
        ref = _np_sparsemax(zr) if alpha == 2 else _np_entmax_bisect(zr, alpha)
        np.testing.assert_allclose(row, ref, atol=2e-5)


def test_bisection_agrees_with_sort_based_maps():
    z = jax.random.normal(jax.random.PRNGKey(1), (5, 17)) * 3
    np.testing.assert_allclose(entmax_bisect(z, 2.0), sparsemax(z), atol=1e-5)
    np.testing.assert_allclose(entmax_bisect(z, 1.5), entmax15(z), atol=1e-5)


def test_alpha_one_limit_is_softmax():
    z = jax.random.normal(jax.random.PRNGKey(2), (4, 12)) * 2
    soft = jax.nn.softmax(z, -1)
    np.testing.assert_allclose(entmax_bisect(z, 1.0), soft, atol=1e-6)
    errs = [float(jnp.abs(entmax_bisect(z, a) - soft).max()) for a in (1.3, 1.1, 1.02)]
    assert errs[0] > errs[1] > errs[2] and errs[2] < 0.03


def _fd_check(f, z, eps=1e-3, atol=2e-3):
    """Custom VJPs against central finite differences (in float64-free float32 with care)."""
    g = np.random.RandomState(0).randn(*z.shape).astype(np.float32)
    auto = jax.grad(lambda z: jnp.sum(f(z) * g))(z)
    num = np.zeros(z.shape, np.float64)
    zf = np.asarray(z, np.float64)
    for idx in np.ndindex(z.shape):
        d = np.zeros_like(zf)
        d[idx] = eps
        num[idx] = (np.sum(np.asarray(f(jnp.asarray(zf + d, jnp.float32))) * g)
                    - np.sum(np.asarray(f(jnp.asarray(zf - d, jnp.float32))) * g)) / (2 * eps)
    np.testing.assert_allclose(auto, num, atol=atol)


@pytest.mark.parametrize("name", list(MAPS))
def test_custom_gradients_match_finite_differences(name):
    fn, _ = MAPS[name]
    z = jax.random.normal(jax.random.PRNGKey(3), (2, 7))
    _fd_check(jax.jit(fn), z)


def test_alpha_gradient_matches_finite_differences():
    z = jax.random.normal(jax.random.PRNGKey(4), (3, 9)) * 2
    g = jax.random.normal(jax.random.PRNGKey(5), z.shape)
    f = lambda a: jnp.sum(entmax_bisect(z, entmax_alpha(a)) * g)
    a = jnp.float32(0.3)
    eps = 1e-2
    num = (f(a + eps) - f(a - eps)) / (2 * eps)
    np.testing.assert_allclose(jax.grad(f)(a), num, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("name", list(MAPS))
def test_masked_inputs_give_zeros_and_finite_gradients(name):
    fn, _ = MAPS[name]
    z = jax.random.normal(jax.random.PRNGKey(6), (3, 10))
    mask = jnp.arange(10) < 6
    p = fn(jnp.where(mask, z, -jnp.inf))
    np.testing.assert_array_equal(np.asarray(p)[:, 6:], 0)
    np.testing.assert_allclose(p, np.pad(np.asarray(fn(z[:, :6])), ((0, 0), (0, 4))), atol=1e-6)
    g = jax.grad(lambda z: jnp.sum(fn(jnp.where(mask, z, -jnp.inf)) ** 2))(z)
    assert np.isfinite(g).all() and np.all(np.asarray(g)[:, 6:] == 0)
    # A fully masked row gives zeros, not NaN.
    empty = fn(jnp.full((1, 5), -jnp.inf))
    np.testing.assert_array_equal(empty, 0)
    assert np.isfinite(jax.grad(lambda z: fn(z).sum())(jnp.full((1, 5), -jnp.inf))).all()


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 1.25])
def test_entmax_attention_reference_causal_padding(alpha):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(7), 3)
    q, k, v = (jax.random.normal(x, (L, D)) for x in (k1, k2, k3))
    mask = jnp.arange(L) < 27
    out = entmax_attention(q, k, v, alpha, causal=True, kv_mask=mask)
    s = np.asarray(q @ k.T / np.sqrt(D), np.float64)
    allowed = np.tril(np.ones((L, L), bool)) & np.asarray(mask)[None]
    ref = np.zeros((L, D))
    for i in range(L):
        zr = s[i][allowed[i]]
        if alpha == 1.0:
            w = np.exp(zr - zr.max()); w /= w.sum()
        elif alpha == 2.0:
            w = _np_sparsemax(zr)
        else:
            w = _np_entmax_bisect(zr, alpha)
        ref[i] = w @ np.asarray(v, np.float64)[allowed[i]]
    np.testing.assert_allclose(out, ref, atol=5e-5)
    # causal no-leak and padding invariance
    t = 20
    out2 = entmax_attention(q, k.at[t:].set(4.0), v.at[t:].set(4.0), alpha, causal=True,
                            kv_mask=mask)
    np.testing.assert_array_equal(out[:t], out2[:t])
    gk = jax.grad(lambda k: entmax_attention(q, k, v, alpha, causal=True, kv_mask=mask)[:t].sum())(k)
    assert np.isfinite(gk).all() and np.all(np.asarray(gk)[t:] == 0)


def test_entmax_attention_learnable_alpha_per_head_bf16():
    from xformers_jax.attention import entmax_attention, multihead  # alpha is traced here
    q = jax.random.normal(jax.random.PRNGKey(8), (2, L, 3, D), jnp.bfloat16)
    a = jnp.array([-1.0, 0.0, 2.0])
    f = multihead(lambda q, k, v, a: entmax_attention(q, k, v, entmax_alpha(a)),
                  arg_axes=("heads",))
    f = jax.jit(f)
    out = f(q, q, q, a)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    q32 = q.astype(jnp.float32)
    ref, pull = jax.vjp(lambda a: f(q32, q32, q32, a), a)
    assert_close(out, ref, dtype=jnp.bfloat16)
    (g,) = pull(jnp.ones_like(ref))
    assert np.isfinite(g).all() and (np.asarray(g) != 0).all()


def test_entmax_errors():
    q = jnp.ones((4, D))
    with pytest.raises(ValueError, match="alpha must be >= 1"):
        entmax_attention(q, q, q, 0.5)
    with pytest.raises(ValueError, match="alpha must be a scalar"):
        entmax_bisect(q, jnp.ones(3))


def test_topk_attention():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(9), 3)
    q, k, v = (jax.random.normal(x, (L, D)) for x in (k1, k2, k3))
    assert_close(topk_attention(q, k, v, top_k=L), dot_product_attention(q, k, v))
    assert_close(topk_attention(q, k, v, top_k=L, causal=True),
                 dot_product_attention(q, k, v, causal=True))
    top = 5
    mask = jnp.arange(L) < 28
    out = topk_attention(q, k, v, top_k=top, causal=True, kv_mask=mask)
    s = np.where(np.tril(np.ones((L, L), bool)) & np.asarray(mask)[None],
                 np.asarray(q @ k.T), -np.inf)
    kth = -np.sort(-s, axis=1)[:, top - 1:top]
    allowed = (s >= kth) & np.isfinite(s)
    assert (allowed.sum(1) == np.minimum(np.arange(1, L + 1), top)).all()
    assert_close(out, dot_product_attention(q, k, v, bias=jnp.where(allowed, 0.0, -jnp.inf)))
    gv = jax.grad(lambda v: topk_attention(q, k, v, top_k=top, kv_mask=mask).sum())(v)
    assert np.all(np.asarray(gv)[28:] == 0)
    outb = topk_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                          top_k=top)
    assert outb.dtype == jnp.bfloat16 and np.isfinite(np.asarray(outb, np.float32)).all()
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        topk_attention(q, k, v, top_k=0)
