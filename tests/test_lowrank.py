"""Linformer, Nyströmformer, Luna and (improved) clustered attention (issue 5).

Exact limits against dot_product_attention, approximation error that falls as rank, landmarks
or clusters grow, padding invariance, causal no-leak or a clear error, bf16, gradients.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT, assert_close
from xformers_jax.attention import (
    clustered_attention,
    dot_product_attention,
    improved_clustered_attention,
    init_linformer_projections,
    init_luna_sequence,
    init_nystrom_conv,
    linformer_attention,
    luna_attention,
    multihead,
    nystrom_attention,
)
from xformers_jax.attention._nystrom import depthwise_conv_skip

L, D = 32, 8


def _qkv(seed=0, lq=L, lk=L, d=D, scale=1.0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (scale * jax.random.normal(kq, (lq, d)), scale * jax.random.normal(kk, (lk, d)),
            jax.random.normal(kv, (lk, d)))


def _smooth(seed=1, length=64, d=16):
    """Smooth sequences: nearby tokens are similar, so pooled keys and landmarks represent
    their segments well and the approximations should improve with resolution."""
    kf, kp = jax.random.split(jax.random.PRNGKey(seed))
    t = jnp.linspace(0, 1, length)[:, None]
    f = 3 * jax.random.normal(kf, (1, d))
    p = jax.random.normal(kp, (1, d))
    wave = lambda a, b: jnp.sin(2 * jnp.pi * a * t + b)
    return 1.5 * wave(f, p), 1.5 * wave(0.7 * f, p + 1), wave(1.3 * f, p - 1)


def _rel_err(out, ref):
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def _mean_pool(k_slots, n):
    seg = (np.arange(n) * k_slots) // n
    m = np.eye(k_slots)[seg].T
    return jnp.asarray(m / m.sum(1, keepdims=True), jnp.float32)


_E, _F = init_linformer_projections(jax.random.PRNGKey(7), L, 8)
_P = init_luna_sequence(jax.random.PRNGKey(8), 6, D)
_CONV = init_nystrom_conv(jax.random.PRNGKey(9), 5)
_KEY = jax.random.PRNGKey(3)


def _jit(fn):
    # Jitted, so each test compiles one program instead of dispatching op by op.
    return jax.jit(fn, static_argnames=("causal",))


# name -> (fn taking q, k, v and contract keywords, whether it offers causal)
VARIANTS = {
    "linformer": (_jit(lambda q, k, v, **kw: linformer_attention(q, k, v, _E, _F, **kw)),
                  False),
    "nystrom": (_jit(lambda q, k, v, **kw: nystrom_attention(q, k, v, _CONV, num_landmarks=4,
                                                             **kw)), False),
    "luna": (_jit(lambda q, k, v, **kw: luna_attention(q, k, v, _P, chunk_size=8, **kw)), True),
    "clustered": (_jit(lambda q, k, v, **kw: clustered_attention(q, k, v, num_clusters=4,
                                                                 key=_KEY, **kw)), False),
    "improved_clustered": (
        _jit(lambda q, k, v, **kw: improved_clustered_attention(q, k, v, num_clusters=4, topk=5,
                                                                key=_KEY, **kw)), False),
}


# --- exact limits ------------------------------------------------------------------------


def test_linformer_identity_is_full_attention():
    q, k, v = _qkv()
    eye = jnp.eye(L)
    assert_close(linformer_attention(q, k, v, eye, eye), dot_product_attention(q, k, v))
    mask = jnp.arange(L) < 20
    assert_close(linformer_attention(q, k, v, eye, kv_mask=mask),
                 dot_product_attention(q, k, v, kv_mask=mask))


def test_linformer_shorter_sequence_uses_leading_columns():
    q, k, v = _qkv(lk=20)
    eye = jnp.eye(L)  # built for n = 32
    assert_close(linformer_attention(q, k, v, eye, eye), dot_product_attention(q, k, v))
    e, f = init_linformer_projections(jax.random.PRNGKey(1), L, 8)
    padded = jnp.pad(k, ((0, 12), (0, 0))), jnp.pad(v, ((0, 12), (0, 0)))
    mask = jnp.arange(L) < 20
    assert_close(linformer_attention(q, k, v, e, f),
                 linformer_attention(q, *padded, e, f, kv_mask=mask))


def test_nystrom_landmarks_equal_tokens_is_full_attention():
    # Scaled inputs keep the softmax matrix well conditioned, so its pseudo-inverse converges.
    q, k, v = _qkv(lq=16, lk=16, scale=2.0)
    out = nystrom_attention(q, k, v, num_landmarks=16, pinv_iterations=25)
    np.testing.assert_allclose(out, dot_product_attention(q, k, v), atol=1e-4, rtol=1e-4)


def test_clustered_one_query_per_cluster_is_full_attention():
    q, k, v = _qkv()
    out = clustered_attention(q, k, v, num_clusters=L, bits=63, key=_KEY)
    assert_close(out, dot_product_attention(q, k, v))


def test_improved_clustered_with_all_keys_is_full_attention():
    q, k, v = _qkv()
    mask = jnp.arange(L) < 27
    out = improved_clustered_attention(q, k, v, num_clusters=3, topk=L, key=_KEY, kv_mask=mask)
    assert_close(out, dot_product_attention(q, k, v, kv_mask=mask))


def test_luna_matches_its_definition():
    q, k, v = _qkv()
    mask = jnp.arange(L) < 25
    weights = dot_product_attention(_P, k, k, kv_mask=mask, return_weights=True)[1]
    ref = dot_product_attention(q, weights @ k, weights @ v)
    out, packed = luna_attention(q, k, v, _P, kv_mask=mask, return_packed=True)
    assert_close(out, ref)
    assert_close(packed, weights @ v)


def test_luna_causal_packs_each_prefix():
    q, k, v = _qkv()
    mask = jnp.arange(L) != 3
    out = luna_attention(q, k, v, _P, causal=True, kv_mask=mask, chunk_size=8)
    for t in (0, 5, 9, L - 1):
        ref = luna_attention(q[t : t + 1], k[: t + 1], v[: t + 1], _P, kv_mask=mask[: t + 1])
        assert_close(out[t : t + 1], ref, err_msg=f"position {t}")


def test_nystrom_conv_skip_is_a_same_padded_correlation():
    v = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (20, 3)))
    w = np.asarray(_CONV)
    ref = np.stack([np.correlate(np.pad(v[:, c], 2), w, mode="valid") for c in range(3)], 1)
    np.testing.assert_allclose(depthwise_conv_skip(jnp.asarray(v), _CONV), ref, atol=1e-5)


def test_nystrom_padding_is_excluded_from_landmarks():
    # A padded sequence gives the landmarks, and so the outputs, of its unpadded prefix,
    # whatever the length modulo the landmark count.
    q, k, v = _qkv(lq=29, lk=29)
    mask = jnp.arange(29) < 19
    nystrom = jax.jit(functools.partial(nystrom_attention, num_landmarks=5))
    out = nystrom(q, k, v, kv_mask=mask, q_mask=mask)
    ref = nystrom(q[:19], k[:19], v[:19])
    assert_close(out[:19], ref)


# --- approximation error falls as the approximation refines ------------------------------


def _falls(errors):
    assert all(a > b for a, b in zip(errors, errors[1:])), errors


def test_linformer_error_falls_with_rank():
    q, k, v = _smooth()
    ref = dot_product_attention(q, k, v)
    errors = [_rel_err(linformer_attention(q, k, v, _mean_pool(r, 64)), ref)
              for r in (4, 8, 16, 32)]
    _falls(errors)
    assert errors[-1] < 0.05
    assert _rel_err(linformer_attention(q, k, v, _mean_pool(64, 64)), ref) < 1e-6


def test_nystrom_error_falls_with_landmarks():
    q, k, v = _smooth()
    ref = dot_product_attention(q, k, v)
    errors = [_rel_err(jax.jit(functools.partial(nystrom_attention, num_landmarks=m))(q, k, v),
                       ref) for m in (4, 8, 16, 32)]
    _falls(errors)
    assert errors[-1] < 0.05


def test_clustered_error_falls_with_clusters():
    keys = jax.random.split(jax.random.PRNGKey(4), 4)
    centres = 1.5 * jax.random.normal(keys[0], (16, 16))
    q = centres[jax.random.randint(keys[1], (64,), 0, 16)]
    q = q + 0.05 * jax.random.normal(keys[2], q.shape)
    k, v = jax.random.normal(keys[3], (2, 64, 16))
    ref = dot_product_attention(q, k, v)
    clustered = lambda c: jax.jit(functools.partial(clustered_attention, num_clusters=c))
    errors = [_rel_err(clustered(c)(q, k, v, key=_KEY), ref) for c in (1, 4, 16, 64)]
    _falls(errors)
    improved = lambda t: jax.jit(functools.partial(improved_clustered_attention, num_clusters=4,
                                                   topk=t))
    improved = [_rel_err(improved(t)(q, k, v, key=_KEY), ref) for t in (1, 8, 32)]
    _falls(improved)
    assert improved[0] <= errors[1] + 1e-6


# --- the contract, for every variant -----------------------------------------------------


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_padding_invariance(name):
    fn, _ = VARIANTS[name]
    q, k, v = _qkv()
    mask = jnp.arange(L) < 21
    noise = jax.random.normal(jax.random.PRNGKey(11), (2, L, D))
    k2 = jnp.where(mask[:, None], k, 100 * noise[0])
    v2 = jnp.where(mask[:, None], v, 100 * noise[1])
    assert_close(fn(q, k2, v2, kv_mask=mask), fn(q, k, v, kv_mask=mask))
    grads = jax.grad(lambda k, v: fn(q, k, v, kv_mask=mask).sum(), argnums=(0, 1))(k, v)
    for g in grads:
        assert np.all(np.asarray(g)[~np.asarray(mask)] == 0)
        assert np.all(np.isfinite(g))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_causal_no_leak_or_clear_error(name):
    fn, offers_causal = VARIANTS[name]
    q, k, v = _qkv()
    if not offers_causal:
        with pytest.raises(NotImplementedError, match="does not support causal=True"):
            fn(q, k, v, causal=True)
        return
    cut = 13
    later = jnp.arange(L)[:, None] >= cut
    k2 = jnp.where(later, k + 5.0, k)
    v2 = jnp.where(later, -v, v)
    out, out2 = fn(q, k, v, causal=True), fn(q, k2, v2, causal=True)
    np.testing.assert_array_equal(out[:cut], out2[:cut])
    grads = jax.grad(lambda k, v: fn(q, k, v, causal=True)[:cut].sum(), argnums=(0, 1))(k, v)
    for g in grads:
        assert np.all(np.asarray(g)[cut:] == 0)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_bf16_matches_float32(name):
    fn, _ = VARIANTS[name]
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv())
    out = fn(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = fn(*(x.astype(jnp.float32) for x in (q, k, v)))
    assert_close(out, ref, dtype=jnp.bfloat16)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_gradients_finite_and_match_finite_differences(name):
    fn, _ = VARIANTS[name]
    q, k, v = _qkv(lq=12, lk=12)
    direction = jax.random.normal(jax.random.PRNGKey(5), v.shape)
    # Clusters are discrete, so differentiate along v (the output is linear in v there).
    f = lambda v: jnp.sum(jnp.sin(fn(q, k, v)))
    g = jax.grad(f)(v)
    assert np.all(np.isfinite(g))
    eps = 1e-2
    fd = (f(v + eps * direction) - f(v - eps * direction)) / (2 * eps)
    np.testing.assert_allclose(jnp.vdot(g, direction), fd, rtol=1e-2, atol=1e-3)
    for arg in (0, 1):
        grad = jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=arg)(q, k, v)
        assert np.all(np.isfinite(grad))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_jit_and_multihead(name):
    fn, _ = VARIANTS[name]
    b, h = 2, 3
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (b, L, h, D)) for i in range(3))
    mask = jnp.arange(L)[None, :] < jnp.array([[L], [17]])
    out = jax.jit(multihead(fn))(q, k, v, kv_mask=mask)
    assert out.shape == (b, L, h, D)
    assert_close(out[1, :, 2], fn(q[1, :, 2], k[1, :, 2], v[1, :, 2], kv_mask=mask[1]))


# --- clear errors ------------------------------------------------------------------------


def test_linformer_rejects_longer_sequences_and_bad_projections():
    q, k, v = _qkv(lk=40)
    with pytest.raises(ValueError, match="at most n=32"):
        linformer_attention(q, k, v, _E, _F)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="same shape"):
        linformer_attention(q, k, v, _E, _F[:4])


def test_bad_hyperparameters_raise():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="num_clusters=40 exceeds"):
        clustered_attention(q, k, v, num_clusters=40, key=_KEY)
    with pytest.raises(ValueError, match="explicit PRNG `key`"):
        clustered_attention(q, k, v, num_clusters=4, key=None)
    with pytest.raises(ValueError, match="num_landmarks"):
        nystrom_attention(q, k, v, num_landmarks=0)
    with pytest.raises(ValueError, match="odd-length kernel"):
        nystrom_attention(q, k, v, jnp.ones(4), num_landmarks=4)
    with pytest.raises(ValueError, match=r"p must be \[l, Dk\]"):
        luna_attention(q, k, v, jnp.ones((4, D + 1)))
    with pytest.raises(ValueError, match="rank 2"):
        luna_attention(q[None], k, v, _P)
