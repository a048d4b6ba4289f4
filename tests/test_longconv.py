"""The long convolutions H3 and Hyena against references written from the papers' equations:
H3's shift SSM as the shift-matrix recurrence and its diagonal SSM as an O(L^2) causal
convolution with explicitly powered kernels; Hyena's recurrence z_{n+1} = x_n (h_n * z_n +
b_n z_n) by O(L^2) convolutions. The FFT forms (and H3's recurrent form, and Hyena's cached
decoding steps) against them, outputs and gradients; padded holes; the reductions (Hyena of
order 1 with the identity filter is a gated short convolution; H3 with one channel per head
is a Hyena of order 2 with filters delta and the S4D kernel); the declared decoding state
against what the layers keep."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax import mixers as M
from xformers_jax import nn

L, H, P, N2 = 13, 2, 3, 3  # length, heads, head width, conjugate pairs


def _jit(f, **kw):
    return jax.jit(f, compiler_options={"xla_backend_optimization_level": 0}, **kw)


def _rand(i, *shape, scale=1.0):
    return scale * jax.random.normal(jax.random.PRNGKey(i), shape)


def _h3_params(shift_size, heads=H, width=P):
    """Real parameters of H3: ``(shift, log_dt, log_a_re, a_im, c_re, c_im, d)``."""
    return (_rand(10, heads, width, shift_size, scale=0.5),
            jnp.log(jnp.linspace(0.05, 0.3, heads)), _rand(11, heads, N2, scale=0.3) - 0.5,
            math.pi * jnp.arange(N2, dtype=jnp.float32) + _rand(12, heads, N2, scale=0.1),
            _rand(13, heads, N2), _rand(14, heads, N2), _rand(15, heads))


def _system(shift, log_dt, log_a_re, a_im, c_re, c_im, d):
    """The arguments of ``M.h3`` after ``q, k, v`` (B = 1, as S4D initialises it)."""
    a = -jnp.exp(log_a_re) + 1j * a_im
    return shift, jnp.exp(log_dt), a, jnp.ones_like(a), c_re + 1j * c_im, d


def _h3_reference(q, k, v, shift, dt, a, b, c, d):
    """H3 from Algorithm 1: the shift SSM ``s_t = A s_{t-1} + e_1 k_t``, ``kbar_t = C s_t``
    (``A`` the shift matrix); per head the diagonal SSM of ``kbar_t v_t^T`` discretised by
    zero-order hold, as the causal convolution with ``K_l = 2 Re sum_n C_n dB_n dA_n^l``
    (powers by repeated products) plus ``D``; ``o_t = q_t KV_t``."""
    length = q.shape[0]
    s_size = shift.shape[-1]
    shift_matrix = jnp.eye(s_size, k=-1)  # (A s)[i] = s[i - 1]
    e1 = jnp.zeros(s_size).at[0].set(1.0)

    def step(s, k_t):
        s = s @ shift_matrix.T + k_t[..., None] * e1
        return s, jnp.sum(shift * s, -1)

    kbar = jax.lax.scan(step, jnp.zeros(shift.shape), k)[1]
    kv = kbar[..., :, None] * v[..., None, :]  # [L, H, P, P]
    da = jnp.exp(dt[:, None] * a)
    db = (da - 1) / a * b
    powers = jnp.cumprod(jnp.broadcast_to(da[..., None], (*da.shape, length)), -1) / da[
        ..., None]  # dA^0 .. dA^(L-1)
    kernel = 2 * jnp.einsum("hn,hnl->hl", c * db, powers).real
    t = jnp.arange(length)
    lag = t[:, None] - t[None, :]
    toeplitz = jnp.where(lag >= 0, kernel[:, jnp.clip(lag, 0)], 0)  # [H, t, s]
    kv_out = jnp.einsum("hts,shij->thij", toeplitz, kv) + d[:, None, None] * kv
    return jnp.einsum("thi,thij->thj", q, kv_out)


@pytest.mark.parametrize("shift_size", [4, 16])  # 16 > L: the shift kernel is truncated
def test_h3_fft_and_recurrent_forms_equal_the_reference(shift_size):
    q, k, v = (_rand(i, L, H, P) for i in range(3))
    params = _h3_params(shift_size)

    def loss_of(fn):
        def loss(q, k, v, params):
            y = fn(q, k, v, *_system(*params))
            return jnp.sum(y * _rand(20, L, H, P)), y
        return _jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

    (_, want), want_grads = loss_of(_h3_reference)(q, k, v, params)
    for form in ("fft", "recurrent"):
        (_, got), grads = loss_of(lambda *a, form=form: M.h3(*a, implementation=form))(
            q, k, v, params)
        assert_close(got, want, EXACT, err_msg=f"h3 {form}: outputs")
        assert_close(grads, want_grads, EXACT_GRAD, err_msg=f"h3 {form}: gradients")


def test_h3_holes_change_no_distance():
    """Padded positions anywhere (a hole in the middle too) neither write nor shift: the real
    outputs are those of the real tokens run alone, whatever the padded content."""
    q, k, v = (_rand(i, L, H, P) for i in range(3))
    mask = jnp.asarray([1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 1, 0], bool)
    system = _system(*_h3_params(4))
    real = np.asarray(mask)
    want = _h3_reference(q[real], k[real], v[real], *system)
    junk = [jnp.where(mask[:, None, None], x, jnp.nan) for x in (q, k, v)]
    for form in ("fft", "recurrent"):
        out = _jit(lambda q, k, v, form=form: M.h3(q, k, v, *system, kv_mask=mask,
                                                   implementation=form))(q, k, v)
        assert_close(out[real], want, EXACT, err_msg=form)
        k_nan = _jit(lambda q, k, v, form=form: M.h3(q, k, v, *system, kv_mask=mask,
                                                     implementation=form))(q, *junk[1:])
        assert_close(k_nan[real], want, EXACT, err_msg=f"{form}: NaN in padded keys/values")


def _short_conv_reference(u, w, b):
    width = w.shape[0]
    return jnp.stack([sum(w[i] * u[t - width + 1 + i] for i in range(width)
                          if t - width + 1 + i >= 0) + b for t in range(u.shape[0])])


def _hyena_reference(u, short_w, short_b, filters, bias):
    """The Hyena recurrence of Poli et al. (Section 3.1): ``z_1 = v``, ``z_{n+1,t} = x_{n,t}
    (sum_{s <= t} h_n[t - s] z_{n,s} + b_n z_{n,t})``, after every stream's short
    convolution."""
    order, dim = bias.shape
    streams = _short_conv_reference(u, short_w, short_b).reshape(u.shape[0], order + 1, dim)
    t = jnp.arange(u.shape[0])
    lag = t[:, None] - t[None, :]
    z = streams[:, 0]
    for n in range(order):
        toeplitz = jnp.where(lag >= 0, filters[n][:, jnp.clip(lag, 0)], 0)  # [D, t, s]
        z = streams[:, n + 1] * (jnp.einsum("dts,sd->td", toeplitz, z) + bias[n] * z)
    return z


def _hyena_params(order, dim, width=3, length=L):
    return (_rand(30, length, (order + 1) * dim), _rand(31, width, (order + 1) * dim, scale=0.6),
            _rand(32, (order + 1) * dim, scale=0.1), _rand(33, order, dim, length, scale=0.3),
            _rand(34, order, dim))


def test_hyena_fft_form_equals_the_reference():
    args = _hyena_params(3, 4)
    cot = _rand(35, L, 4)

    def grads(fn):
        return _jit(jax.value_and_grad(lambda a: (jnp.sum(fn(*a) * cot), fn(*a)),
                                       has_aux=True))(args)

    (_, want), want_grads = grads(_hyena_reference)
    (_, got), got_grads = grads(M.hyena)
    assert_close(got, want, EXACT)
    assert_close(got_grads, want_grads, EXACT_GRAD)


def test_hyena_holes_and_cached_steps():
    u, w, b, filters, bias = _hyena_params(2, 4)
    mask = jnp.asarray([1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 1, 0], bool)
    real = np.asarray(mask)
    n_real = int(real.sum())
    want = _hyena_reference(u[real], w, b, filters[..., :n_real], bias)
    junk = jnp.where(mask[:, None], u, jnp.nan)
    out = _jit(lambda u: M.hyena(u, w, b, filters, bias, kv_mask=mask))(junk)
    assert_close(out[real], want, EXACT, err_msg="a hole or its content changed a real output")
    # Decoding: one cached step per position (capacity 16 > L) equals the forward pass.
    capacity = 16
    long_filters = jnp.concatenate([filters, _rand(36, 2, 4, capacity - L)], -1)
    state = (jnp.zeros((w.shape[0] - 1, w.shape[1])), jnp.zeros((2, capacity, 4)))

    def step(state, inputs):
        u_t, t = inputs
        y, state = M.hyena_step(state, u_t, t, w, b, long_filters, bias)
        return state, y

    steps = _jit(lambda u: jax.lax.scan(step, state, (u, jnp.arange(L)))[1])(u)
    assert_close(steps, _hyena_reference(u, w, b, filters, bias), EXACT)


def test_hyena_of_order_one_with_the_identity_filter_is_a_gated_convolution():
    """``h_1 = delta`` (tap 0 only), bias ``b``: ``y = (1 + b) x_1 v``, the product of the two
    short-convolved streams."""
    u, w, b, _, bias = _hyena_params(1, 4)
    delta = jnp.zeros((1, 4, L)).at[..., 0].set(1.0)
    streams = M.causal_depthwise_conv(u[None], w, b)[0]
    v, x1 = streams[:, :4], streams[:, 4:]
    assert_close(_jit(M.hyena)(u, w, b, delta, bias), (1 + bias[0]) * x1 * v, EXACT)


def test_h3_with_one_channel_per_head_is_a_hyena_of_order_two():
    """H3 at ``P = 1`` is Hyena of order 2 (Poli et al. 2023, Section 3): ``v`` as ``z_1``,
    the keys through the shift taps as ``x_1`` with ``h_1 = delta``, ``b_1 = 0``; the queries
    as ``x_2`` with ``h_2`` the diagonal SSM's kernel and ``b_2 = D``."""
    dim, s = 4, 3
    shift, dt, a, b, c, d = _system(*_h3_params(s, heads=dim, width=1))
    q, k, v = (_rand(i, L, dim, 1) for i in range(3))
    identity = jnp.zeros((s, dim)).at[-1].set(1.0)  # the tap that reads the current input
    short_w = jnp.concatenate([identity, shift[:, 0, ::-1].T, identity], -1)
    filters = jnp.stack([jnp.zeros((dim, L)).at[:, 0].set(1.0), M.s4d_kernel(dt, a, b, c, L)])
    bias = jnp.stack([jnp.zeros(dim), d])
    u = jnp.concatenate([v[..., 0], k[..., 0], q[..., 0]], -1)
    hyena = _jit(M.hyena)(u, short_w, jnp.zeros(3 * dim), filters, bias)
    assert_close(_jit(M.h3)(q, k, v, shift, dt, a, b, c, d)[..., 0], hyena, EXACT)


def test_hyena_filters_are_the_windowed_ffn_of_positions():
    """``h(t) = exp(-alpha_d t') FFN(PE(t'))``, ``t' = t / max_len``, ``PE = [t', cos(2 pi k
    t'), sin(2 pi k t')]``, an FFN with sine activations; a filter does not depend on the
    length it is materialised at (a prefix's filters are the longer run's first taps)."""
    layer = _jit(lambda key: nn.MixerSpec("hyena", {"filter_width": 8, "emb_dim": 5}).build(
        4, 2, causal=True, max_len=16, key=key))(jax.random.PRNGKey(0))
    t = np.arange(16) / 16
    pe = np.stack([t, np.cos(2 * np.pi * t), np.cos(4 * np.pi * t), np.sin(2 * np.pi * t),
                   np.sin(4 * np.pi * t)], -1)
    w1, b1, w2, b2, w3, freq = (np.asarray(x, np.float64) for x in (
        layer.f_w1, layer.f_b1, layer.f_w2, layer.f_b2, layer.f_w3, layer.freq))
    ffn = np.sin(freq * (np.sin(freq * (pe @ w1 + b1)) @ w2 + b2)) @ w3  # [t, N D]
    rates = np.log(100) / np.linspace(1.5, 0.3, 4)  # decay to 1% over 1.5 .. 0.3 of max_len
    want = ffn.reshape(16, 2, 4) * np.exp(-t[:, None, None] * rates)
    got = _jit(lambda m: m.filters(16))(layer)
    assert_close(got, np.transpose(want, (1, 2, 0)), EXACT)
    assert_close(_jit(lambda m: m.filters(11))(layer), got[..., :11], EXACT)


def _numbers(tree):
    """Real numbers held (a complex number is two)."""
    return sum(math.prod(x.shape) * (2 if jnp.issubdtype(x.dtype, jnp.complexfloating) else 1)
               for x in jax.tree.leaves(tree))


def _cache_numbers(name, hp, max_len, cache_len):
    """Real numbers in the causal layer's decoding cache (shapes only: nothing runs)."""
    def cache():
        layer = nn._mixer.make_mixer(nn.MixerSpec(name, hp), 16, 2, causal=True,
                                     max_len=max_len, key=jax.random.PRNGKey(0))
        return layer.init_cache(1, cache_len).state

    return _numbers(jax.eval_shape(cache))


def test_declared_decoding_state_is_what_the_layers_keep():
    # H3 (D = 16, P = 2, S = 3, N = 4): (S - 1) D keys and D P N / 2 complex states.
    assert nn.get_kind("mixer", "h3").state_size == "(S - 1) D + D P N"
    hp = {"state_size": 4, "shift_size": 3, "head_dim": 2}
    assert _cache_numbers("h3", hp, 16, 16) == (3 - 1) * 16 + 16 * 2 * 4
    # Hyena (N = 3, W = 3): N D per cached token, plus the short convolution's buffer.
    assert nn.get_kind("mixer", "hyena").state_size == "N D per token + (W - 1)(N + 1) D"
    for length in (8, 32):
        assert _cache_numbers("hyena", {"order": 3}, 32, length) == \
            3 * 16 * length + (3 - 1) * 4 * 16
    with pytest.raises(ValueError, match="only the causal form decodes"):
        jax.eval_shape(lambda: nn._mixer.make_mixer(
            nn.MixerSpec("h3", hp), 16, 2, causal=False, max_len=16,
            key=jax.random.PRNGKey(0)).init_cache(1, 16))


def test_errors_name_the_problem():
    q = _rand(0, L, H, P)
    with pytest.raises(ValueError, match=r"h3: need q, k, v \[L, H, P\].*shift \(2, 2, 4\)"):
        M.h3(q, q, q, *_system(*_h3_params(4, width=2)))
    with pytest.raises(ValueError, match="implementation must be one of"):
        M.h3(q, q, q, *_system(*_h3_params(4)), implementation="chunked")
    u, w, b, filters, bias = _hyena_params(2, 4)
    with pytest.raises(ValueError, match=r"hyena: need .*filters \(2, 4, 12\)"):
        M.hyena(u, w, b, filters[..., :12], bias)
    with pytest.raises(ValueError, match=r"kv_mask must be bool\[13\], got shape \(12,\)"):
        M.hyena(u, w, b, filters, bias, kv_mask=jnp.ones(12, bool))
    with pytest.raises(ValueError, match="H3: need shift_size >= 1 and head_dim >= 1 dividing"):
        nn.MixerSpec("h3", {"head_dim": 3}).build(16, 2, causal=True, max_len=8,
                                                  key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="an odd emb_dim"):
        nn.MixerSpec("hyena", {"emb_dim": 4}).build(16, 2, causal=True, max_len=8,
                                                    key=jax.random.PRNGKey(0))
