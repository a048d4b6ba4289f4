"""Token mixers (xformers_jax.mixers): every form of a recurrence equals every other and a
numpy loop written from the paper's equations (outputs and gradients); the MLP / Fourier /
pooling / lambda mixers against dense references; padding; bf16; errors; long sequences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax import mixers as M

L, DK, DV = 13, 4, 3


def _jit(f, **kw):
    # Tiny shapes: compile without backend optimisation (the compile dominates).
    return jax.jit(f, compiler_options={"xla_backend_optimization_level": 0}, **kw)
CHUNK = 4  # does not divide L: the padded last chunk is exercised


def _rand(key, *shape, scale=1.0):
    return scale * jax.random.normal(key, shape)


def _np(*xs):
    return [np.asarray(x, np.float64) for x in xs]


def _linear_loop(fq, fk, v, decay):
    """S_t = diag(decay_t) S_{t-1} + fk_t v_t^T, o_t = fq_t S_t; decay [L] or [L, M]."""
    fq, fk, v, decay = _np(fq, fk, v, decay)
    s = np.zeros((fq.shape[1], v.shape[1]))
    out = []
    for t in range(len(fq)):
        d = decay[t] if decay.ndim == 1 else decay[t][:, None]
        s = d * s + np.outer(fk[t], v[t])
        out.append(fq[t] @ s)
    return np.stack(out)


def _gated_delta_loop(q, k, v, beta, a):
    q, k, v, beta, a = _np(q, k, v, beta, a)
    s = np.zeros((k.shape[1], v.shape[1]))
    out = []
    for t in range(len(q)):
        # S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T (Yang et al. 2025, Eq. 10)
        s = a[t] * (np.eye(k.shape[1]) - beta[t] * np.outer(k[t], k[t])) @ s \
            + beta[t] * np.outer(k[t], v[t])
        out.append(q[t] @ s)
    return np.stack(out)


def _inputs(key):
    ks = jax.random.split(key, 8)
    q, k = _rand(ks[0], L, DK, scale=0.5), _rand(ks[1], L, DK, scale=0.5)
    v = _rand(ks[2], L, DV)
    k_unit = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    return dict(
        retnet=((q, k, v, jnp.log(0.9)),
                lambda q, k, v, lg: _linear_loop(q, k, v, np.full(L, 0.9))),
        gla=((q, k, v, jax.nn.log_sigmoid(_rand(ks[3], L, DK)) / 4),
             lambda q, k, v, g: _linear_loop(q, k, v, np.exp(np.asarray(g)))),
        mamba2=((v, jax.nn.softplus(_rand(ks[4], L)), -0.7, k, q),
                # h_t = exp(dt_t a) h_{t-1} + dt_t B_t x_t^T, y_t = C_t h_t (Dao and Gu 2024)
                lambda x, dt, a, b, c: _linear_loop(c, np.asarray(b) * np.asarray(dt)[:, None],
                                                    x, np.exp(np.asarray(dt) * a))),
        gated_deltanet=((q, k_unit, v, jax.nn.sigmoid(_rand(ks[5], L)),
                         -jax.nn.softplus(_rand(ks[6], L))),
                        lambda q, k, v, beta, ld: _gated_delta_loop(q, k, v, beta, np.exp(ld))),
    )


FUNCTIONS = dict(retnet=M.retention, gla=M.gla, mamba2=M.ssd, gated_deltanet=M.gated_delta)
# Differentiable inputs per kind (the rest are constants).
DIFF = dict(retnet=(0, 1, 2), gla=(0, 1, 2, 3), mamba2=(0, 1, 3, 4), gated_deltanet=(0, 1, 2, 3, 4))


@pytest.mark.parametrize("kind", sorted(FUNCTIONS))
def test_recurrence_forms_equal_reference_and_each_other(key, kind):
    args, reference = _inputs(key)[kind]
    fn = FUNCTIONS[kind]
    want = reference(*args)
    w = jax.random.normal(jax.random.PRNGKey(3), want.shape)
    grads = {}
    for form in ("parallel", "recurrent", "chunked"):
        def loss(*a, form=form):
            out = fn(*a, implementation=form, chunk_size=CHUNK)
            return jnp.sum(out * w), out

        (_, out), grads[form] = _jit(jax.value_and_grad(loss, argnums=DIFF[kind],
                                                        has_aux=True))(*args)
        assert_close(out, want, EXACT, err_msg=f"{kind} {form}")
    for form in ("recurrent", "chunked"):
        for g, g_ref in zip(grads[form], grads["parallel"]):
            assert_close(g, g_ref, EXACT_GRAD, err_msg=f"{kind} grad {form} vs parallel")


def _s4d_system(key, h=3, n=4):
    ks = jax.random.split(key, 5)
    dt = jnp.exp(jax.random.uniform(ks[0], (h,), minval=-4, maxval=-1))
    a = -0.5 + 1j * jnp.pi * jnp.arange(n) + 0 * jnp.zeros((h, 1))
    b = _rand(ks[1], h, n) + 1j * _rand(ks[2], h, n)
    c = _rand(ks[3], h, n) + 1j * _rand(ks[4], h, n)
    return dt, a, b, c


def _s4d_reference(u, dt, a, b, c, d, c_rev=None):
    """Dense Vandermonde kernel and Toeplitz convolution from Gu et al. 2022 (ZOH)."""
    u, d = _np(u, d)
    dt, a, b, c = (np.asarray(x) for x in (dt, a, b, c))
    length = len(u)
    da = np.exp(dt[:, None] * a)
    db = (da - 1) / a * b
    powers = da[..., None] ** np.arange(length)
    k = 2 * np.einsum("hn,hnl->hl", c * db, powers).real
    y = np.stack([sum(k[:, t - s] * u[s] for s in range(t + 1)) for t in range(length)])
    if c_rev is not None:
        kr = 2 * np.einsum("hn,hnl->hl", np.asarray(c_rev) * db, powers).real
        y = y + np.stack([sum(kr[:, s - t] * u[s] for s in range(t, length))
                          for t in range(length)])
    return y + d * u


# block 4 < L = 13: the kernel's blocked Vandermonde product over several blocks, the last one
# partly past L; the default block covers L in one.
@pytest.mark.parametrize("bidirectional,block", [(False, None), (True, 4)])
def test_s4d_fft_recurrence_and_vandermonde_agree(key, bidirectional, block, monkeypatch):
    if block is not None:
        monkeypatch.setattr("xformers_jax.mixers._ssm.KERNEL_BLOCK", block)
    dt, a, b, c = _s4d_system(key)
    u = _rand(jax.random.PRNGKey(5), L, 3)
    d = _rand(jax.random.PRNGKey(6), 3)
    c_rev = jnp.conj(c) * 0.5 if bidirectional else None
    want = _s4d_reference(u, dt, a, b, c, d, c_rev)
    w = _rand(jax.random.PRNGKey(7), L, 3)
    grads = []
    for form in ("fft", "recurrent"):
        def loss(u, dt, form=form):
            out = M.s4d(u, dt, a, b, c, d, c_reverse=c_rev, implementation=form)
            return jnp.sum(out * w), out

        (_, out), g = _jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(u, dt)
        assert_close(out, want, EXACT, err_msg=form)
        grads.append(g)
    for g1, g2 in zip(*grads):
        assert_close(g1, g2, EXACT_GRAD)
    if not bidirectional:  # decoding step by step equals the convolution
        steps = jax.lax.scan(lambda x, u_t: M.s4d_step(x, u_t, dt, a, b, c, d)[::-1],
                             jnp.zeros(a.shape, jnp.complex64), u)[1]
        assert_close(steps, want, EXACT)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_s4d_holes_neither_write_nor_decay(key, bidirectional):
    # Padded positions in the middle (and at both ends): the real outputs equal S4D over the
    # real tokens alone, in both forms, so a hole changes no distance between real tokens.
    dt, a, b, c = _s4d_system(key)
    mask = jnp.asarray(np.isin(np.arange(L), [0, 4, 5, 9], invert=True))
    u = jnp.where(mask[:, None], _rand(jax.random.PRNGKey(5), L, 3), 7.0)
    d = _rand(jax.random.PRNGKey(6), 3)
    c_rev = jnp.conj(c) * 0.5 if bidirectional else None
    want = _s4d_reference(np.asarray(u)[np.asarray(mask)], dt, a, b, c, d, c_rev)
    for form in ("fft", "recurrent"):
        out = _jit(lambda u, form=form: M.s4d(u, dt, a, b, c, d, c_reverse=c_rev, kv_mask=mask,
                                              implementation=form))(u)
        assert_close(np.asarray(out)[np.asarray(mask)], want, EXACT,
                     err_msg=f"{form}: a hole changed the real outputs")


def _s5_reference(u, lam, dt, b, c, d, c_rev=None):
    u, d = _np(u, d)
    lam, dt, b, c = (np.asarray(x) for x in (lam, dt, b, c))
    lam_bar = np.exp(lam * dt)
    b_bar = ((lam_bar - 1) / lam)[:, None] * b
    def run(order):
        x = np.zeros(len(lam), complex)
        out = {}
        for t in order:
            x = lam_bar * x + b_bar @ u[t]
            out[t] = x
        return np.stack([out[t] for t in range(len(u))])
    y = (run(range(len(u))) @ c.T).real
    if c_rev is not None:
        y = y + (run(range(len(u) - 1, -1, -1)) @ np.asarray(c_rev).T).real
    return y + d * u


@pytest.mark.parametrize("bidirectional", [False, True])
def test_s5_associative_equals_sequential_and_reference(key, bidirectional):
    ks = jax.random.split(key, 6)
    p, h = 5, 3
    lam = -jnp.exp(_rand(ks[0], p) - 1) + 1j * _rand(ks[1], p)
    dt = jnp.exp(jax.random.uniform(ks[2], (p,), minval=-3, maxval=-1))
    b = _rand(ks[3], p, h) + 1j * _rand(ks[4], p, h)
    c = (_rand(ks[5], h, p) + 1j * _rand(ks[0], h, p)) / 3
    c_rev = jnp.conj(c) if bidirectional else None
    u, d = _rand(jax.random.PRNGKey(1), L, h), _rand(jax.random.PRNGKey(2), h)
    want = _s5_reference(u, lam, dt, b, c, d, c_rev)
    w = _rand(jax.random.PRNGKey(7), L, h)
    grads = []
    for form in ("associative", "sequential"):
        def loss(u, dt, form=form):
            out = M.s5(u, lam, dt, b, c, d, c_reverse=c_rev, implementation=form)
            return jnp.sum(out * w), out

        (_, out), g = _jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(u, dt)
        assert_close(out, want, EXACT, err_msg=form)
        grads.append(g)
    for g1, g2 in zip(*grads):
        assert_close(g1, g2, EXACT_GRAD)


def _selective_reference(x, delta, a, b, c, reverse=False):
    x, delta, a, b, c = _np(x, delta, a, b, c)
    h = np.zeros(a.shape)
    out = np.zeros_like(x)
    order = range(len(x) - 1, -1, -1) if reverse else range(len(x))
    for t in order:
        # Gu and Dao 2023, Algorithm 2: dA = exp(delta A), dB x = delta B x.
        h = np.exp(delta[t][:, None] * a) * h + (delta[t] * x[t])[:, None] * b[t][None, :]
        out[t] = h @ c[t]
    return out


@pytest.mark.parametrize("reverse", [False, True])
def test_selective_scan_forms_agree(key, reverse):
    ks = jax.random.split(key, 5)
    d, n = 3, 4
    x, b, c = _rand(ks[0], L, d), _rand(ks[1], L, n), _rand(ks[2], L, n)
    delta = jax.nn.softplus(_rand(ks[3], L, d))
    a = -jnp.exp(_rand(ks[4], d, n))
    want = _selective_reference(x, delta, a, b, c, reverse)
    w = _rand(jax.random.PRNGKey(9), L, d)
    grads = []
    # group_positions=5 < L: the state is carried across groups of the associative scan.
    for form, group in (("associative", 5), ("sequential", 5), ("loop", 5)):
        f = lambda x, delta, a, b, c, form=form, group=group: M.selective_scan(  # noqa: E731
            x, delta, a, b, c, implementation=form, group_positions=group, reverse=reverse)
        (_, out), g = _jit(jax.value_and_grad(lambda *z: (jnp.sum(f(*z) * w), f(*z)),
                                              argnums=(0, 1, 2, 3, 4), has_aux=True))(
            x, delta, a, b, c)
        assert_close(out, want, EXACT, err_msg=form)
        grads.append(g)
    for other in grads[1:]:
        for g1, g2 in zip(grads[0], other):
            assert_close(g1, g2, EXACT_GRAD)


def _mask(length, real):
    return jnp.arange(length) < real


@pytest.mark.parametrize("kind", sorted(FUNCTIONS))
def test_recurrence_padding_changes_no_real_output(key, kind):
    args, _ = _inputs(key)[kind]
    fn = FUNCTIONS[kind]
    real = 9
    junk = [a if jnp.ndim(a) == 0 else a.at[real:].set(7.0) for a in args]
    f = _jit(lambda *a, kv_mask=None: fn(*a, kv_mask=kv_mask, chunk_size=CHUNK))
    base = f(*[a if jnp.ndim(a) == 0 else a[:real] for a in args])
    out = f(*junk, kv_mask=_mask(L, real))
    assert_close(out[:real], base, EXACT)


def test_mlp_mixers_against_references(key):
    ks = jax.random.split(key, 8)
    max_len, t, d = 16, 5, 4
    x = _rand(ks[0], L, d)
    w1, b1 = _rand(ks[1], t, max_len), _rand(ks[2], t)
    w2, b2 = _rand(ks[3], max_len, t), _rand(ks[4], max_len)
    xn, = _np(x)
    h = np.asarray(jax.nn.gelu(jnp.asarray(np.asarray(w1)[:, :L] @ xn + np.asarray(b1)[:, None])))
    assert_close(_jit(M.token_mixing_mlp)(x, w1, b1, w2, b2),
                 np.asarray(w2)[:L] @ h + np.asarray(b2)[:L, None], EXACT)
    # gMLP's SGU: z1 * (W z2 + b), W lower-triangular when causal (Liu et al. 2021, Eq. 2-3).
    z = _rand(ks[5], L, 2 * d)
    w, bs = _rand(ks[6], max_len, max_len), _rand(ks[7], max_len)
    zn, wn, bn = _np(z, w, bs)
    for causal in (False, True):
        wl = np.tril(wn[:L, :L]) if causal else wn[:L, :L]
        assert_close(_jit(M.spatial_gating, static_argnames="causal")(z, w, bs, causal=causal),
                     zn[:, :d] * (wl @ zn[:, d:] + bn[:L, None]), EXACT)
    # FNet: Re(FFT_seq(FFT_hidden(x))) over max_len positions (zero rows after L).
    xp = np.zeros((max_len, d))
    xp[:L] = xn
    assert_close(M.fourier_mixing(x, max_len=max_len), np.fft.fft2(xp).real[:L], EXACT)
    # PoolFormer: mean of the real neighbours in a window of 3, minus x.
    pool = np.stack([xn[max(0, i - 1): i + 2].mean(0) for i in range(L)]) - xn
    assert_close(M.pool_mixing(x), pool, EXACT)


@pytest.mark.parametrize("window", [None, 2])
def test_lambda_layer_against_equations(key, window):
    ks = jax.random.split(key, 4)
    h, kd, vd, radius = 2, 3, 4, L - 1
    q, k, v = _rand(ks[0], L, h, kd), _rand(ks[1], L, kd), _rand(ks[2], L, vd)
    rel = _rand(ks[3], 2 * radius + 1, kd)
    qn, kn, vn, reln = _np(q, k, v, rel)
    sk = np.exp(kn - kn.max(0)) / np.exp(kn - kn.max(0)).sum(0)
    content = sk.T @ vn  # lambda^c = softmax(K)^T V  (Bello 2021, Eq. 2)
    r = radius if window is None else window
    want = np.zeros((L, h, vd))
    for n in range(L):
        # lambda^p_n = sum_m E_{nm}^T v_m over the (local) context
        lam_p = sum(np.outer(reln[m - n + radius], vn[m]) for m in range(L) if abs(m - n) <= r)
        want[n] = qn[n] @ (content + lam_p)
    assert_close(_jit(M.lambda_mixing, static_argnames="window")(q, k, v, rel, window=window),
                 want, EXACT)


def test_non_recurrent_mixers_padding(key):
    ks = jax.random.split(key, 6)
    max_len, d, real = 16, 4, 9
    x = _rand(ks[0], L, d)
    junk = x.at[real:].set(5.0)
    m = _mask(L, real)
    w1, b1, w2, b2 = (_rand(ks[1], 5, max_len), _rand(ks[2], 5), _rand(ks[3], max_len, 5),
                      _rand(ks[4], max_len))
    w, bs = _rand(ks[5], max_len, max_len), _rand(ks[1], max_len)
    rel = _rand(ks[2], 2 * max_len - 1, 2)
    q3 = _rand(ks[3], L, 2, 2)
    cases = {
        "mlp_mixer": lambda x, m: M.token_mixing_mlp(x, w1, b1, w2, b2, kv_mask=m),
        "gmlp": lambda x, m: M.spatial_gating(x, w, bs, kv_mask=m),
        "fnet": lambda x, m: M.fourier_mixing(x, max_len=max_len, kv_mask=m),
        "poolformer": lambda x, m: M.pool_mixing(x, kv_mask=m),
        "lambda": lambda x, m: M.lambda_mixing(q3[: len(x)], x[:, :2], x, rel, kv_mask=m),
    }
    for name, f in cases.items():
        f = _jit(f)
        base = f(x[:real], None)
        assert_close(f(junk, m)[:real], base, EXACT, err_msg=name)  # junk content
        assert_close(f(junk[:11], m[:11])[:real], base, EXACT, err_msg=name)  # another amount


def test_bf16_inputs(key):
    args, reference = _inputs(key)["gla"]
    bf = [a.astype(jnp.bfloat16) for a in args]
    out = M.gla(*bf, chunk_size=CHUNK)
    assert out.dtype == jnp.float32 and jnp.isfinite(out).all()
    want = reference(*[np.asarray(a, np.float32) for a in bf])
    assert_close(out, want, EXACT, dtype=jnp.bfloat16)
    x = _rand(key, L, 4).astype(jnp.bfloat16)
    y = M.fourier_mixing(x, max_len=16)
    assert y.dtype == jnp.bfloat16
    assert_close(y, M.fourier_mixing(x.astype(jnp.float32), max_len=16), EXACT,
                 dtype=jnp.bfloat16)


def test_clear_errors(key):
    q = _rand(key, L, DK)
    with pytest.raises(ValueError, match=r"implementation must be one of"):
        M.retention(q, q, q, -0.1, implementation="fast")
    with pytest.raises(ValueError, match=r"same length"):
        M.retention(q, q[:5], q, -0.1)
    with pytest.raises(ValueError, match=r"log_gates must have k's shape"):
        M.gla(q, q, q, q[:, :2])
    with pytest.raises(ValueError, match=r"kv_mask must be bool\[13\]"):
        M.ssd(q, jnp.ones(L), -1.0, q, q, kv_mask=jnp.ones(5, bool))
    with pytest.raises(ValueError, match=r"exceeds the 8 positions"):
        M.fourier_mixing(q, max_len=8)
    with pytest.raises(ValueError, match=r"pool_size must be a positive odd"):
        M.pool_mixing(q, pool_size=2)
    with pytest.raises(ValueError, match=r"R >= L - 1"):
        M.lambda_mixing(q[:, None], q, q, _rand(key, 3, DK))


@pytest.mark.slow
def test_recurrences_finite_at_65536(key):
    # fp32 at L = 65536 with tiny widths (one forward each): no overflow from decays however
    # long the sequence (cumulative decays are applied as in-chunk differences).
    n = 65536
    ks = jax.random.split(key, 4)
    q, k, v = _rand(ks[0], n, 2), _rand(ks[1], n, 2), _rand(ks[2], n, 2)
    ld = -jax.nn.softplus(_rand(ks[3], n))
    outs = _jit(lambda q, k, v, ld: {
        "retnet": M.retention(q, k, v, jnp.log(0.999)),
        "gla": M.gla(q, k, v, jnp.stack([ld, ld / 2], -1)),
        "mamba2": M.ssd(v, -ld, -1.0, k, q),
        "gated_deltanet": M.gated_delta(q, k / jnp.linalg.norm(k, axis=-1, keepdims=True), v,
                                        jax.nn.sigmoid(ld), ld),
        "mamba": M.selective_scan(v, jnp.exp(q), -jnp.ones((2, 2)), k, q),
        "s4d": M.s4d(v, jnp.full((2,), 0.01), -0.5 + 1j * jnp.ones((2, 2)),
                     jnp.ones((2, 2), jnp.complex64), jnp.ones((2, 2), jnp.complex64),
                     jnp.ones(2)),
        "s5": M.s5(v, -0.5 + 1j * jnp.ones(2), jnp.full((2,), 0.01),
                   jnp.ones((2, 2), jnp.complex64), jnp.ones((2, 2), jnp.complex64),
                   jnp.ones(2)),
    })(q, k, v, ld)
    for name, out in outs.items():
        assert out.shape[0] == n and bool(jnp.isfinite(out).all()), name


@pytest.mark.parametrize("c", [13, 64])
def test_unit_lower_inverse_equals_the_inverse(c):
    # The chunked delta rule's (I + tril(diag(beta) Gamma K K^T, -1))^-1: random systems and
    # repeated keys (every strict entry beta = 0.9, the worst case for growth of intermediates).
    from xformers_jax.attention.linear._delta import unit_lower_inverse

    rng = np.random.default_rng(c)
    strict = np.concatenate([np.tril(rng.normal(size=(2, c, c)) * 0.3, -1),
                             np.tril(np.full((1, c, c), 0.9), -1)])
    got = _jit(unit_lower_inverse)(jnp.asarray(strict, jnp.float32))
    assert_close(got, np.linalg.inv(np.eye(c) + strict), EXACT)
