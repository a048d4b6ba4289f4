"""Attention with priors (Gaussian priors, hard-coded Gaussian, average attention) against
references written from the papers' equations: outputs and gradients, reductions to vanilla
attention, causal no-leak from a middle token, padding, bf16, decoding, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xformers_jax.attention as A
from tests.tolerances import EXACT, EXACT_GRAD, assert_close

L, D = 12, 8
jit0 = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def compare(fn, ref, args, argnums=None, row_weight=None):
    """Outputs and gradients of ``fn`` (compiled once, forward and gradient in one program)
    against the reference ``ref`` (eager dense jnp) on a loss that weights every output."""
    argnums = tuple(range(len(args))) if argnums is None else argnums

    def loss(f):
        def run(*a):
            out = f(*a)
            w = 1.0 if row_weight is None else row_weight.reshape(
                row_weight.shape + (1,) * (out.ndim - 1))
            return jnp.sum(jnp.sin(out.astype(jnp.float32)) * w), out
        return jax.value_and_grad(run, argnums=argnums, has_aux=True)

    (_, out), grads = jit0(loss(fn))(*args)
    (_, want), want_grads = loss(ref)(*args)
    assert_close(out, want)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
        assert_close(a, b, EXACT_GRAD)
    return out


def _qkv(seed=0, dtype=jnp.float32, lq=L, lk=L):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(k1, (lq, D), dtype), jax.random.normal(k2, (lk, D), dtype),
            jax.random.normal(k3, (lk, D), dtype))


def _softmax_ref(scores, visible):
    """Row softmax over the visible entries (jnp, differentiable), zero rows when none."""
    s = jnp.where(visible, scores, -1e30)
    w = jnp.exp(s - s.max(-1, keepdims=True)) * visible
    return w / jnp.maximum(w.sum(-1, keepdims=True), 1e-30)


def _visible(lq, lk, causal, mask):
    vis = np.ones((lq, lk), bool)
    if causal:
        vis &= np.arange(lk)[None] <= np.arange(lq)[:, None]
    if mask is not None:
        vis &= np.asarray(mask)[None]
    return vis


# --- Yang et al. (2018): predicted centre and window ------------------------------------------

def _yang_ref(q, k, v, params, causal, mask):
    w_p, u_p, u_d = params
    # The paper's I, the sequence length, is the number of keys a query may see: all real keys,
    # or when causal those up to the query itself (a prefix must not depend on what follows).
    real = np.ones(L) if mask is None else np.asarray(mask, float)
    n = jnp.asarray(np.cumsum(real) if causal else np.full(L, real.sum()), jnp.float32)
    h = jnp.tanh(q @ w_p)
    p = n * jax.nn.sigmoid(h @ u_p)                     # eq. 5: the centre
    sig = n * jax.nn.sigmoid(h @ u_d) / 2               # eqs. 6-7: D_i, sigma = D_i / 2
    j = jnp.arange(k.shape[0])[None, :]
    g = -((j - p[:, None]) ** 2) / (2 * sig[:, None] ** 2)
    s = q @ k.T / np.sqrt(D) + g
    return _softmax_ref(s, _visible(q.shape[0], k.shape[0], causal, mask)) @ v


@pytest.mark.parametrize("causal", [True])
def test_gaussian_prior_matches_paper_outputs_and_gradients(causal):
    q, k, v = _qkv(0)
    params = A.init_gaussian_window(jax.random.PRNGKey(5), D)
    mask = np.arange(L) < L - 3
    f = lambda q, k, v, p: A.gaussian_prior_attention(q, k, v, p, causal=causal,  # noqa: E731
                                                       kv_mask=mask, block_q=4, block_k=4)
    compare(f, lambda q, k, v, p: _yang_ref(q, k, v, p, causal, mask), (q, k, v, params))


def test_gaussian_prior_wide_window_is_vanilla_and_centres_pull_attention():
    q, k, v = _qkv(1)
    f = jit0(lambda c, s: A.gaussian_prior_attention(q, k, v, center=c, sigma=s))
    wide = f(jnp.zeros(L), jnp.full(L, 1e6))
    assert_close(wide, A.dot_product_attention(q, k, v))
    # A narrow window centred at key 3 makes every query take (nearly) v[3].
    narrow = f(jnp.full(L, 3.0), jnp.full(L, 0.05))
    np.testing.assert_allclose(narrow, jnp.broadcast_to(v[3], narrow.shape), atol=1e-5)


def test_gaussian_prior_errors_name_the_problem():
    q, k, v = _qkv(0)
    with pytest.raises(ValueError, match="either the predictor params or both center"):
        A.gaussian_prior_attention(q, k, v)
    with pytest.raises(ValueError, match=r"shape \(Lq,\) = \(12,\)"):
        A.gaussian_prior_attention(q, k, v, center=jnp.zeros(3), sigma=jnp.ones(3))
    with pytest.raises(ValueError, match="rank 2"):
        A.gaussian_prior_attention(q[None], k, v, center=jnp.zeros(L), sigma=jnp.ones(L))


# --- Guo et al. (2019): learned distance penalty ----------------------------------------------

def _guo_ref(q, k, v, w, b, causal, mask):
    i, j = np.arange(q.shape[0])[:, None], np.arange(k.shape[0])[None, :]
    s = q @ k.T / np.sqrt(D) - jnp.abs(w * (i - j) ** 2 + b)
    return _softmax_ref(s, _visible(q.shape[0], k.shape[0], causal, mask)) @ v


@pytest.mark.parametrize("causal", [True])
def test_distance_prior_matches_paper_and_zero_prior_is_vanilla(causal):
    q, k, v = _qkv(2)
    mask = np.arange(L) != 4
    f = lambda q, k, v, w, b: A.distance_prior_attention(  # noqa: E731
        q, k, v, w, b, causal=causal, kv_mask=mask, block_q=4, block_k=4)
    compare(f, lambda q, k, v, w, b: _guo_ref(q, k, v, w, b, causal, mask),
            (q, k, v, jnp.float32(0.3), jnp.float32(-0.7)))
    zero = f(q, k, v, jnp.float32(0), jnp.float32(0))
    assert_close(zero, A.dot_product_attention(q, k, v, causal=causal, kv_mask=mask))


# --- You et al. (2020): hard-coded Gaussian ---------------------------------------------------

@pytest.mark.parametrize("causal,offset", [(False, 1.0), (True, -1.0)])
def test_hardcoded_gaussian_matches_fixed_weights(causal, offset):
    q, k, v = _qkv(3)
    mask = np.arange(L) < L - 2
    std = 1.5
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    w = np.exp(-((j - i - offset) ** 2) / (2 * std ** 2)) * _visible(L, L, causal, mask)
    ref = (w / np.maximum(w.sum(-1, keepdims=True), 1e-30)) @ np.asarray(v)
    f = lambda q, k, v: A.hardcoded_gaussian_attention(  # noqa: E731
        q, k, v, offset=offset, std=std, causal=causal, kv_mask=mask)
    out = jit0(f)(q, k, v)
    assert_close(out, ref)
    # Nothing depends on q or k.
    assert_close(jit0(f)(q * 3, -k, v), out)
    gv = jit0(jax.grad(lambda v: jnp.sum(f(q, k, v) ** 2)))(v)
    # out = W v, so d sum(out^2) / dv = W^T (2 out).
    assert_close(gv, (w / w.sum(-1, keepdims=True)).T @ (2 * np.asarray(out)), EXACT_GRAD)
    with pytest.raises(ValueError, match="std must be positive"):
        A.hardcoded_gaussian_attention(q, k, v, std=0.0)


# --- Zhang et al. (2018): average attention network -------------------------------------------

def _aan_ref(q, v, gate, causal, mask):
    m = np.ones(L) if mask is None else np.asarray(mask, float)
    rows = []
    for i in range(L):
        sel = m * ((np.arange(L) <= i) if causal else 1.0)
        rows.append((sel[:, None] * v).sum(0) / max(sel.sum(), 1.0))   # eq. 1: the average
    g = jnp.stack(rows)
    z = jnp.concatenate([q, g], -1) @ gate.w + gate.b                   # eq. 2: the gates
    i_g, f_g = jax.nn.sigmoid(z[:, :D]), jax.nn.sigmoid(z[:, D:])
    # eq. 3; a padded position's own value is selected out by the contract (its row is padding,
    # which the module zeros, either way)
    return i_g * (m[:, None] * v) + f_g * g


@pytest.mark.parametrize("causal", [False, True])
def test_average_attention_matches_paper_outputs_and_gradients(causal):
    q, k, v = _qkv(4)
    gate = A.init_average_gate(jax.random.PRNGKey(1), D, D)
    gate = gate._replace(b=jax.random.normal(jax.random.PRNGKey(2), gate.b.shape))
    mask = np.arange(L) < L - 4
    compare(lambda q, v, gate: A.average_attention(q, k, v, gate, causal=causal, kv_mask=mask),
            lambda q, v, gate: _aan_ref(q, v, gate, causal, mask), (q, v, gate),
            row_weight=jnp.asarray(mask, jnp.float32))
    # Without a gate it is the plain cumulative average.
    plain = A.average_attention(q, k, v, causal=causal)
    ref = np.cumsum(v, 0) / np.arange(1, L + 1)[:, None] if causal else \
        np.broadcast_to(np.mean(v, 0), v.shape)
    assert_close(plain, ref)


def test_average_attention_decodes_step_by_step_as_the_parallel_form():
    q, k, v = _qkv(5)
    gate = A.init_average_gate(jax.random.PRNGKey(1), D, D)
    parallel = A.average_attention(q, k, v, gate, causal=True)

    def step(state, x):
        out, state = A.average_attention_step(state, *x, gate)
        return state, out

    _, steps = jax.lax.scan(step, A.average_attention_init_state(D), (q, k, v))
    assert_close(steps, parallel)


def test_average_attention_causal_no_leak_padding_and_bf16():
    q, k, v = _qkv(6)
    gate = A.init_average_gate(jax.random.PRNGKey(1), D, D)
    f = lambda q, v, **kw: A.average_attention(q, k, v, gate, causal=True, **kw)  # noqa: E731
    base, t = f(q, v), L // 2
    moved = f(q.at[t].add(1.0), v.at[t].add(1.0))
    np.testing.assert_array_equal(np.asarray(moved[:t]), np.asarray(base[:t]))
    assert float(jnp.abs(moved[t:] - base[t:]).max()) > 1e-3
    # Padding: junk after the real tokens and more of it change no real row.
    n = L - 3
    pad = lambda x, extra: jnp.concatenate([x[:n], 9 * jnp.ones((L - n + extra, D))])  # noqa
    for extra in (0, 5):
        out = A.average_attention(pad(q, extra), pad(k, extra), pad(v, extra), gate,
                                  kv_mask=np.arange(L + extra) < n)
        ref = A.average_attention(q[:n], k[:n], v[:n], gate)
        assert_close(out[:n], ref)
    out16 = A.average_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                                v.astype(jnp.bfloat16), gate, causal=True)
    assert out16.dtype == jnp.bfloat16
    assert_close(out16, base, EXACT, dtype=jnp.bfloat16)


def test_average_attention_errors():
    q, k, v = _qkv(0, lq=L, lk=L + 2)
    with pytest.raises(ValueError, match=r"self-attention \(Lq == Lk\)"):
        A.average_attention(q, k, v)
    q, k, v = _qkv(0)
    with pytest.raises(ValueError, match=r"w \[Dk \+ Dv, 2 Dv\]"):
        A.average_attention(q, k, v, A.init_average_gate(jax.random.PRNGKey(0), 4, 4))


def test_priors_jit_vmap_grad_and_bf16_through_multihead():
    q, k, v = (jax.random.normal(kk, (2, L, 2, D)) for kk in jax.random.split(
        jax.random.PRNGKey(7), 3))
    f = A.multihead(A.distance_prior_attention)
    out = jit0(lambda q, k, v: f(q, k, v, 0.2, -0.1, causal=True))(q, k, v)
    ref = jax.vmap(jax.vmap(lambda a, b, c: _guo_ref(a, b, c, 0.2, -0.1, True, None),
                            in_axes=1, out_axes=1))(q, k, v)
    assert_close(out, ref)
    out16 = jit0(lambda q, k, v: f(q, k, v, 0.2, -0.1, causal=True))(
        q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    assert out16.dtype == jnp.bfloat16
    assert_close(out16, ref, EXACT, dtype=jnp.bfloat16)


def test_average_attention_language_model_decodes_as_its_forward():
    import equinox as eqx
    import xformers_jax.models as models
    import xformers_jax.nn as nn

    model = models.CausalLM(20, 16, 1, 2, 32, max_len=L,
                        block=dict(spec=nn.AttentionSpec("average")), key=jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, L), 0, 20)
    full = eqx.filter_jit(model)(tokens)
    steps, _ = eqx.filter_jit(model.prefill)(tokens, model.init_cache(2, L))
    assert_close(steps, full)
