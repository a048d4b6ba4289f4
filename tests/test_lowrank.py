"""Linformer, Nyströmformer, Luna and (improved) clustered attention.

Exact limits against dot_product_attention, approximation error that falls as rank, landmarks
or clusters grow, padding invariance, causal no-leak or a clear error, bf16, gradients.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT_GRAD, assert_close
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
from xformers_jax.attention.lowrank._nystrom import depthwise_conv_skip

L, D = 32, 8


def _jit(fn, static=()):
    """Every computation here is jitted, so a test compiles one program instead of dispatching
    op by op, and tests share shapes and keywords so most calls reuse a compiled program. These
    programs run in microseconds and compiling them is the test's cost, mostly in LLVM's
    optimisation passes: backend optimisation level 0 halves it (same numerics to rounding)."""
    return jax.jit(fn, static_argnames=static,
                   compiler_options={"xla_backend_optimization_level": 0})


def _qkv(seed=0, lq=L, lk=L, d=D, scale=1.0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (scale * jax.random.normal(kq, (lq, d)), scale * jax.random.normal(kk, (lk, d)),
            jax.random.normal(kv, (lk, d)))


@functools.partial(_jit, static=("seed", "length", "d"))
def _smooth(seed=1, length=64, d=16):
    """Smooth sequences: nearby tokens are similar, so pooled keys and landmarks represent
    their segments well and the approximations should improve with resolution."""
    kf, kp = jax.random.split(jax.random.PRNGKey(seed))
    t = jnp.linspace(0, 1, length)[:, None]
    f = 3 * jax.random.normal(kf, (1, d))
    p = jax.random.normal(kp, (1, d))
    wave = lambda a, b: jnp.sin(2 * jnp.pi * a * t + b)
    return 1.5 * wave(f, p), 1.5 * wave(0.7 * f, p + 1), wave(1.3 * f, p - 1)


def _mean_pool(k_slots, n):
    seg = (np.arange(n) * k_slots) // n
    m = np.eye(k_slots)[seg].T
    return jnp.asarray(m / m.sum(1, keepdims=True), jnp.float32)


_E, _F = init_linformer_projections(jax.random.PRNGKey(7), L, 8)
_P = init_luna_sequence(jax.random.PRNGKey(8), 6, D)
_CONV = init_nystrom_conv(jax.random.PRNGKey(9), 5)
_KEY = jax.random.PRNGKey(3)


dpa = _jit(dot_product_attention, ("causal", "return_weights"))
lin = _jit(linformer_attention, ("causal",))
MASK = jnp.arange(L) < 21


# name -> (fn taking q, k, v and contract keywords, whether it offers causal)
VARIANTS = {
    "linformer": (lambda q, k, v, **kw: linformer_attention(q, k, v, _E, _F, **kw), False),
    "nystrom": (lambda q, k, v, **kw: nystrom_attention(q, k, v, _CONV, num_landmarks=4, **kw),
                False),
    "luna": (lambda q, k, v, **kw: luna_attention(q, k, v, _P, chunk_size=8, **kw), True),
    "clustered": (lambda q, k, v, **kw: clustered_attention(q, k, v, num_clusters=4, key=_KEY,
                                                            **kw), False),
    "improved_clustered": (
        lambda q, k, v, **kw: improved_clustered_attention(q, k, v, num_clusters=4, topk=5,
                                                           key=_KEY, **kw), False),
}


@functools.partial(_jit, static=("name", "causal"))
def _fwd(name, q, k, v, **kw):
    return VARIANTS[name][0](q, k, v, **kw)


@functools.partial(_jit, static=("name", "causal"))
def _run(name, q, k, v, cotangent, *, kv_mask, causal=False):
    """One program per variant for the contract tests: the output and the gradients of
    ``<cotangent, output>`` with respect to q, k and v."""
    fn = VARIANTS[name][0]
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, kv_mask=kv_mask, causal=causal), q, k, v)
    return out, vjp(cotangent)


def _cotangent(seed=12):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((L, D)), jnp.float32)


# --- exact limits ------------------------------------------------------------------------


def test_linformer_identity_is_full_attention():
    q, k, v = _qkv()
    eye = jnp.eye(L)
    assert_close(lin(q, k, v, eye, eye), dpa(q, k, v))
    assert_close(lin(q, k, v, eye, kv_mask=MASK), dpa(q, k, v, kv_mask=MASK))


@pytest.mark.parametrize("masked", ["none", "some", "all"])
def test_short_softmax_attention_matches_dense(masked):
    # Linformer's attention over its slots: the hand-written backward must give
    # dot_product_attention's outputs and gradients, masked keys none, and a query that sees
    # no key zeros.
    from xformers_jax.attention._dense import short_softmax_attention

    q, k, v = _qkv()
    kv_mask = {"none": None, "some": MASK, "all": jnp.zeros((L,), bool)}[masked]
    scale = 0.3

    def ours(q, k, v):
        return short_softmax_attention(q, k, v, kv_mask=kv_mask, scale=scale)

    def ref(q, k, v):
        return dot_product_attention(q, k, v, kv_mask=kv_mask, scale=scale)

    ct = _cotangent()
    out, vjp = jax.vjp(jax.jit(ours), q, k, v)
    out_ref, vjp_ref = jax.vjp(ref, q, k, v)
    assert_close(out, out_ref)
    for g, g_ref in zip(vjp(ct), vjp_ref(ct)):
        assert_close(g, g_ref)
        assert np.all(np.isfinite(g))
    if kv_mask is not None:
        gk, gv = vjp(ct)[1:]
        assert np.all(np.asarray(gk)[~np.asarray(kv_mask)] == 0)
        assert np.all(np.asarray(gv)[~np.asarray(kv_mask)] == 0)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out_b = ours(qb, kb, vb)
    assert out_b.dtype == jnp.bfloat16
    assert_close(out_b, ref(qb, kb, vb), dtype=jnp.bfloat16)


def test_linformer_shorter_sequence_uses_leading_columns():
    q, k, v = _qkv(lk=20)
    eye = jnp.eye(L)  # built for n = 32
    assert_close(lin(q, k, v, eye, eye), dpa(q, k, v))
    padded = jnp.pad(k, ((0, 12), (0, 0))), jnp.pad(v, ((0, 12), (0, 0)))
    mask = jnp.arange(L) < 20
    assert_close(lin(q, k, v, _E, _F), lin(q, *padded, _E, _F, kv_mask=mask))


def test_nystrom_landmarks_equal_tokens_is_full_attention():
    # Scaled inputs keep the softmax matrix well conditioned, so its pseudo-inverse converges.
    q, k, v = _qkv(lq=16, lk=16, scale=2.0)
    out = _jit(functools.partial(nystrom_attention, num_landmarks=16, pinv_iterations=25))(
        q, k, v)
    np.testing.assert_allclose(out, dpa(q, k, v), atol=1e-4, rtol=1e-4)


def test_clustered_one_query_per_cluster_is_full_attention():
    q, k, v = _qkv()
    out = _jit(functools.partial(clustered_attention, num_clusters=L, bits=63))(q, k, v, key=_KEY)
    assert_close(out, dpa(q, k, v))


def test_improved_clustered_with_all_keys_is_full_attention():
    q, k, v = _qkv()
    out = _jit(functools.partial(improved_clustered_attention, num_clusters=3, topk=L))(
        q, k, v, key=_KEY, kv_mask=MASK)
    # The padding mask also marks the padded queries (self-attention): their rows are zero.
    assert_close(out[MASK], dpa(q, k, v, kv_mask=MASK)[MASK])
    assert not np.any(np.asarray(out)[~np.asarray(MASK)])


def test_luna_matches_its_definition():
    q, k, v = _qkv()
    weights = dpa(_P, k, k, kv_mask=MASK, return_weights=True)[1]
    ref = dpa(q, weights @ k, weights @ v)
    out, packed = _jit(luna_attention, ("return_packed",))(
        q, k, v, _P, kv_mask=MASK, return_packed=True)
    assert_close(out, ref)
    assert_close(packed, weights @ v)


@_jit
def _luna_paths(q, k, v, p, masks, ct, ct_packed):
    """Per kv_mask: (out, packed) and the gradients of <ct, out> + <ct_packed, packed> with
    respect to q, k, v, p, from the non-causal path through short_softmax_attention, from
    the generic path (a traced scale takes it) and from the dense formula."""
    scale = D ** -0.5

    def dense(q, k, v, p, kv_mask):
        weights = dot_product_attention(p, k, k, kv_mask=kv_mask, return_weights=True)[1]
        return dot_product_attention(q, weights @ k, weights @ v), weights @ v

    fns = {
        "short": lambda *a, kv_mask: luna_attention(*a, kv_mask=kv_mask, return_packed=True),
        "generic": lambda *a, kv_mask: luna_attention(*a, kv_mask=kv_mask, return_packed=True,
                                                      scale=jnp.float32(scale)),
        "dense": lambda *a, kv_mask: dense(*a, kv_mask),
    }
    out = {}
    for name, fn in fns.items():
        for i, mask in enumerate(masks):
            res, vjp = jax.vjp(lambda q, k, v, p: fn(q, k, v, p, kv_mask=mask), q, k, v, p)
            out[name, i] = res, vjp((ct, ct_packed))
    return out


def test_luna_short_attention_path_matches_generic_and_dense():
    """The non-causal form through short_softmax_attention (hand-written backward passes)
    computes the same function and gradients as the generic path and the dense formula:
    without a mask, with padding, and with every key masked (zero output, zero gradients)."""
    q, k, v = _qkv()
    ct = _cotangent()
    ct_packed = jnp.asarray(np.random.default_rng(13).standard_normal(_P.shape), jnp.float32)
    masks = (None, MASK, jnp.zeros(L, bool))
    res = _luna_paths(q, k, v, _P, masks, ct, ct_packed)
    for i in range(len(masks)):
        (out, packed), grads = res["short", i]
        for ref in ("generic", "dense"):
            (ref_out, ref_packed), ref_grads = res[ref, i]
            assert_close(out, ref_out, err_msg=f"{ref} mask {i}")
            assert_close(packed, ref_packed, err_msg=f"{ref} mask {i}")
            for g, rg in zip(grads, ref_grads):
                assert_close(g, rg, EXACT_GRAD, err_msg=f"{ref} mask {i}")
    (out, packed), grads = res["short", 2]
    assert not np.any(out) and not np.any(packed)
    assert all(not np.any(g) for g in grads)


def test_luna_causal_packs_each_prefix():
    q, k, v = _qkv()
    mask = jnp.arange(L) != 3
    out = _run("luna", q, k, v, _cotangent(), kv_mask=mask, causal=True)[0]
    # Every position t against the non-causal form over its prefix (the keys after t masked:
    # masked keys are as good as absent, see test_padding_invariance).
    prefix = lambda t: luna_attention(q[t][None], k, v, _P, kv_mask=mask & (jnp.arange(L) <= t))
    ref = _jit(jax.vmap(prefix))(jnp.arange(L))[:, 0]
    assert_close(out, ref)


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
    nystrom = _jit(functools.partial(nystrom_attention, num_landmarks=5))
    out = nystrom(q, k, v, kv_mask=mask, q_mask=mask)
    ref = nystrom(q[:19], k[:19], v[:19])
    assert_close(out[:19], ref)


# --- approximation error falls as the approximation refines ------------------------------


def _falls(errors):
    assert all(a > b for a, b in zip(errors, errors[1:])), errors


# Each test below computes all its errors in one jitted program: one compilation instead of
# one per rank, landmark count or cluster count.


def _errors(outs, ref):
    return [float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref)) for o in outs]


def test_linformer_error_falls_with_rank():
    q, k, v = _smooth()
    pools = [_mean_pool(r, 64) for r in (4, 8, 16, 32, 64)]
    outs = _jit(lambda q, k, v, pools: [linformer_attention(q, k, v, e) for e in pools])(
        q, k, v, pools)
    errors = _errors(outs, dpa(q, k, v))
    _falls(errors[:4])
    assert errors[3] < 0.05
    assert errors[4] < 1e-6


def test_nystrom_error_falls_with_landmarks():
    q, k, v = _smooth()
    outs = _jit(lambda q, k, v: [nystrom_attention(q, k, v, num_landmarks=m)
                                    for m in (4, 8, 16, 32)])(q, k, v)
    errors = _errors(outs, dpa(q, k, v))
    _falls(errors)
    assert errors[-1] < 0.05


@_jit
def _clustered_outputs(key):
    """Queries around 16 centres, random keys and values (clusters should find the centres),
    and the outputs of clustered attention with 1, 4, 16, 64 clusters and of improved
    clustered attention with 4 clusters and top 1, 8, 32 keys."""
    keys = jax.random.split(jax.random.PRNGKey(4), 4)
    centres = 1.5 * jax.random.normal(keys[0], (16, 16))
    q = centres[jax.random.randint(keys[1], (64,), 0, 16)]
    q = q + 0.05 * jax.random.normal(keys[2], q.shape)
    k, v = jax.random.normal(keys[3], (2, 64, 16))
    plain = [clustered_attention(q, k, v, num_clusters=c, key=key) for c in (1, 4, 16, 64)]
    improved = [improved_clustered_attention(q, k, v, num_clusters=4, topk=t, key=key)
                for t in (1, 8, 32)]
    return dot_product_attention(q, k, v), plain, improved


def test_clustered_error_falls_with_clusters():
    ref, plain, improved = _clustered_outputs(_KEY)
    errors = _errors(plain, ref)
    _falls(errors)
    improved = _errors(improved, ref)
    _falls(improved)
    assert improved[0] <= errors[1] + 1e-6


# --- the contract, for every variant -----------------------------------------------------


# The contract tests share one compiled program per variant and dtype: ``_run`` on [L, D]
# inputs with a kv_mask.


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_padding_invariance_and_gradients(name):
    q, k, v = _qkv()
    ct = _cotangent()
    noise = 100 * jnp.asarray(np.random.default_rng(11).standard_normal((2, L, D)), jnp.float32)
    k2 = jnp.where(MASK[:, None], k, noise[0])
    v2 = jnp.where(MASK[:, None], v, noise[1])
    out, grads = _run(name, q, k, v, ct, kv_mask=MASK)
    assert_close(_run(name, q, k2, v2, ct, kv_mask=MASK)[0], out)
    for g in grads:
        assert np.all(np.isfinite(g))
    for g in grads[1:]:
        assert np.all(np.asarray(g)[~np.asarray(MASK)] == 0)
    # Clusters are discrete, so check the gradient against finite differences along v (the
    # output is linear in v there).
    f = lambda v: jnp.vdot(ct, _run(name, q, k, v, ct, kv_mask=MASK)[0])
    direction = jnp.asarray(np.random.default_rng(5).standard_normal(v.shape), jnp.float32)
    eps = 1e-2
    fd = (f(v + eps * direction) - f(v - eps * direction)) / (2 * eps)
    np.testing.assert_allclose(jnp.vdot(grads[2], direction), fd, rtol=1e-2, atol=1e-3)


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
    ct = jnp.where(later, 0.0, jnp.ones((L, D)))  # the cotangent of out[:cut].sum()
    out, grads = _run(name, q, k, v, ct, kv_mask=None, causal=True)
    out2 = _run(name, q, k2, v2, ct, kv_mask=None, causal=True)[0]
    np.testing.assert_array_equal(out[:cut], out2[:cut])
    for g in grads[1:]:
        assert np.all(np.asarray(g)[cut:] == 0)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_bf16_matches_float32(name):
    q, k, v = _qkv()
    out = _fwd(name, *(x.astype(jnp.bfloat16) for x in (q, k, v)), kv_mask=MASK)
    assert out.dtype == jnp.bfloat16
    up = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
    ref = _run(name, up(q), up(k), up(v), _cotangent(), kv_mask=MASK)[0]
    assert_close(out, ref, dtype=jnp.bfloat16)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_jit_and_multihead(name):
    fn, _ = VARIANTS[name]
    b, h = 2, 3
    rng = np.random.default_rng(6)
    q, k, v = (jnp.asarray(rng.standard_normal((b, L, h, D)), jnp.float32) for _ in range(3))
    mask = jnp.stack([jnp.ones(L, bool), MASK])
    out = _jit(multihead(fn))(q, k, v, kv_mask=mask)
    assert out.shape == (b, L, h, D)
    ref = _run(name, q[1, :, 2], k[1, :, 2], v[1, :, 2], _cotangent(), kv_mask=mask[1])[0]
    assert_close(out[1, :, 2], ref)


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
