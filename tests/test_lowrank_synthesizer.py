"""Synthesizer and Informer ProbSparse attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import assert_close
from xformers_jax.attention import (
    dot_product_attention,
    init_synthesizer,
    probsparse_attention,
    synthesizer_attention,
)

L, D, N = 24, 8, 32
_KEY = jax.random.PRNGKey(3)
SYNTHETIC = ("dense", "random", "fixed_random", "factorized_dense", "factorized_random")
PARAMS = {kind: init_synthesizer(jax.random.PRNGKey(i), kind, D, N)
          for i, kind in enumerate(SYNTHETIC)}
synth = jax.jit(synthesizer_attention, static_argnames=("causal",))


def _qkv(seed=0, length=L):
    return tuple(jax.random.normal(jax.random.PRNGKey(seed + i), (length, D)) for i in range(3))


def test_mixture_reduces_to_dot_product():
    q, k, v = _qkv()
    mask = jnp.arange(L) < 19
    params = {"dot": None, "random": PARAMS["random"], "dense": PARAMS["dense"]}
    out = synth(q, k, v, params, {"dot": 1.0, "random": 0.0, "dense": 0.0}, causal=True,
                kv_mask=mask)
    assert_close(out, dot_product_attention(q, k, v, causal=True, kv_mask=mask))
    half = synth(q, k, v, {"dot": None}, {"dot": 0.5})
    assert_close(half, dot_product_attention(q, k, v, scale=0.5 / np.sqrt(D)))


def test_random_synthesizer_is_softmax_of_its_matrix():
    q, k, v = _qkv()
    logits = jnp.pad(q @ k.T / np.sqrt(D), ((0, N - L), (0, N - L)))
    assert_close(synth(q, k, v, {"random": logits}), dot_product_attention(q, k, v))
    r1, r2 = PARAMS["factorized_random"]
    assert_close(synth(q, k, v, {"factorized_random": (r1, r2)}),
                 synth(q, k, v, {"random": r1 @ r2.T}))


def test_factorized_dense_tiles_and_repeats():
    q, k, v = _qkv()
    wa, wb = PARAMS["factorized_dense"]
    a, b = wa.shape[1], wb.shape[1]
    assert a * b == N
    j = np.arange(L)
    logits = (q @ wa)[:, j % a] * (q @ wb)[:, j // a]
    ref = dot_product_attention(jnp.zeros_like(q), k, v, bias=logits)
    assert_close(synth(q, k, v, {"factorized_dense": (wa, wb)}), ref)


@pytest.mark.parametrize("causal", [False, True])
def test_synthetic_only_path_matches_the_dense_reference(causal):
    # Without a "dot" form no q k^T is computed; masking, causality and gradients must be
    # those of dense attention with the synthetic logits as its bias.
    q, k, v = _qkv()
    mask = jnp.arange(L) < 17
    r = PARAMS["random"][:L, :L]

    def ours(r, v):
        return synth(q, k, v, {"random": r}, causal=causal, kv_mask=mask)

    def ref(r, v):
        return dot_product_attention(jnp.zeros_like(q), k, v, bias=r, causal=causal,
                                     kv_mask=mask)

    assert_close(ours(r, v), ref(r, v))
    g = jax.grad(lambda *a: jnp.sum(ours(*a) ** 2), argnums=(0, 1))(r, v)
    g_ref = jax.grad(lambda *a: jnp.sum(ref(*a) ** 2), argnums=(0, 1))(r, v)
    for a, b in zip(g, g_ref):
        assert_close(a, b)


def test_fixed_random_is_not_trained():
    q, k, v = _qkv()
    r = PARAMS["random"]
    g_fixed = jax.grad(lambda r: synth(q, k, v, {"fixed_random": r}).sum())(r)
    g_trained = jax.grad(lambda r: jnp.sum(synth(q, k, v, {"random": r}) ** 2))(r)
    assert np.all(g_fixed == 0)
    assert np.any(g_trained != 0) and np.all(np.isfinite(g_trained))


@pytest.mark.parametrize("kind", SYNTHETIC)
def test_causal_no_leak(kind):
    q, k, v = _qkv()
    cut = 9
    later = jnp.arange(L)[:, None] >= cut
    # The dense forms read the queries as their tokens, so perturb future queries too.
    q2, k2, v2 = (jnp.where(later, x + 3.0, x) for x in (q, k, v))
    params = {kind: PARAMS[kind]}
    out, out2 = synth(q, k, v, params, causal=True), synth(q2, k2, v2, params, causal=True)
    np.testing.assert_array_equal(out[:cut], out2[:cut])
    grads = jax.grad(lambda q, k, v: synth(q, k, v, params, causal=True)[:cut].sum(),
                     argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.all(np.asarray(g)[cut:] == 0) and np.all(np.isfinite(g))


@pytest.mark.parametrize("kind", SYNTHETIC)
def test_padding_invariance_and_bf16(kind):
    q, k, v = _qkv()
    mask = jnp.arange(L) < 15
    params = {kind: PARAMS[kind], "dot": None}
    k2, v2 = (jnp.where(mask[:, None], x, 50.0) for x in (k, v))
    assert_close(synth(q, k2, v2, params, kv_mask=mask), synth(q, k, v, params, kv_mask=mask))
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = synth(qb, kb, vb, params)
    assert out.dtype == jnp.bfloat16
    ref = synth(*(x.astype(jnp.float32) for x in (qb, kb, vb)), params)
    assert_close(out, ref, dtype=jnp.bfloat16)


def test_synthesizer_errors():
    q, k, v = _qkv(length=40)
    with pytest.raises(ValueError, match="at most 32"):
        synthesizer_attention(q, k, v, {"random": PARAMS["random"]})
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown synthesizer form"):
        synthesizer_attention(q, k, v, {"magic": None})
    with pytest.raises(ValueError, match="missing from params"):
        synthesizer_attention(q, k, v, {"dot": None}, {"random": 1.0})
    with pytest.raises(ValueError, match="kind must be one of"):
        init_synthesizer(_KEY, "magic", D, N)


# --- ProbSparse ----------------------------------------------------------------------------

probsparse = jax.jit(probsparse_attention, static_argnames=("factor", "causal"))


def test_probsparse_all_queries_active_is_full_attention():
    q, k, v = _qkv()
    mask = jnp.arange(L) < 20
    out = probsparse(q, k, v, key=_KEY, factor=50.0, kv_mask=mask)
    # The padding mask also marks the padded queries (self-attention): their rows are zero.
    assert_close(out[:20], dot_product_attention(q, k, v, kv_mask=mask)[:20])
    assert not np.any(np.asarray(out[20:]))


def test_probsparse_error_falls_with_factor():
    q, k, v = _qkv(length=64)
    q = 2.0 * q
    ref = dot_product_attention(q, k, v)
    errors = [float(jnp.linalg.norm(probsparse(q, k, v, key=_KEY, factor=c) - ref))
              for c in (1.0, 3.0, 8.0, 16.0)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-5


def test_probsparse_lazy_queries_get_mean_of_real_values():
    q, k, v = _qkv()
    mask = jnp.arange(L) < 17
    out = probsparse(q, k, v, key=_KEY, factor=1.0, kv_mask=mask)
    mean = v[:17].mean(0)
    lazy = np.all(np.isclose(out[:17], mean, atol=1e-6), axis=1)
    # u = ceil(ln 17) of the 17 real queries attend (the count is the real tokens', not L's);
    # the padded queries' rows are zero.
    assert lazy.sum() == 17 - int(np.ceil(np.log(17)))
    assert not np.any(np.asarray(out[17:]))


def test_probsparse_padding_grads_bf16_and_errors():
    q, k, v = _qkv()
    mask = jnp.arange(L) < 18
    k2, v2 = (jnp.where(mask[:, None], x, -40.0) for x in (k, v))
    f = functools.partial(probsparse, key=_KEY, factor=2.0, kv_mask=mask)
    assert_close(f(q, k2, v2), f(q, k, v))
    grads = jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.all(np.isfinite(g))
    assert np.all(np.asarray(grads[2])[18:] == 0)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = probsparse(qb, kb, vb, key=_KEY, factor=2.0)
    assert out.dtype == jnp.bfloat16
    assert_close(out, probsparse(*(x.astype(jnp.float32) for x in (qb, kb, vb)), key=_KEY,
                                 factor=2.0), dtype=jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="does not support causal=True"):
        probsparse_attention(q, k, v, key=_KEY, causal=True)
    with pytest.raises(ValueError, match="explicit PRNG `key`"):
        probsparse_attention(q, k, v, key=None)
