"""Modules of the long convolutions H3 and Hyena (the one-sequence functions are
``mixers.h3`` and ``mixers.hyena``, trained by FFT).

Both are causal language-model mixers; both run packed rows (``segment_ids``: every
convolution stays inside its document). Without ``causal`` they run the same operator a second
time from the last position (the outputs added: a bidirectional form for encoders, not in the
papers). The diagonal SSM parameters of H3 (``log_dt``, ``log_a_re``, ``a_im``, ``b_re``,
``b_im``) get the optimizer's state space learning rate and no weight decay, as S4D's.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ... import mixers as M
from .._slots import implements
from ._base import (MixerModule, both_ways, check_mask, dense, log_uniform, recurrent_cache,
                    s4d_lin, zero_padded)


def _axis(x):
    """vmap's axis for an optional per-row argument (``kv_mask``, ``segment_ids``)."""
    return None if x is None else 0


def _no_bidirectional_cache(name, causal):
    if not causal:
        raise ValueError(f"{name}.init_cache: only the causal form decodes (the bidirectional "
                         "form reads later positions)")


@implements("h3")
class H3(MixerModule):
    """H3 (Fu et al. 2023, Algorithm 1): ``q, k, v = x W_q, x W_k, x W_v``; the shift SSM on
    ``k`` (``shift_size`` taps per channel); per head of ``head_dim`` channels the outer
    products ``kbar_t v_t^T`` through a diagonal SSM (S4D-Lin initialisation ``A_n = -1/2 + i
    pi n``, one system of ``state_size / 2`` conjugate pairs per head, ``D`` skip); ``o_t =
    q_t KV_t``; output projection. ``head_dim = 1`` (the released code's default) is the
    elementwise ``q * SSM(shift(k) * v)``.

    Hyperparameters: ``state_size`` (N, even), ``shift_size`` (S), ``head_dim`` (P, divides
    ``dim``), ``dt_min``, ``dt_max``, ``implementation`` (``"fft"`` or ``"recurrent"``).
    Decoding keeps ``(S - 1) D`` past key numbers and ``D P N / 2`` complex SSM states per
    sequence: ``O(1)`` in the length.
    """

    w_qkv: jax.Array
    shift: jax.Array
    log_dt: jax.Array
    log_a_re: jax.Array
    a_im: jax.Array
    b_re: jax.Array
    b_im: jax.Array
    c: jax.Array
    d: jax.Array
    w_out: jax.Array
    causal: bool = eqx.field(static=True)
    implementation: str = eqx.field(static=True)

    def __init__(self, dim, num_heads, *, causal, max_len, key, state_size=64, shift_size=64,
                 head_dim=1, dt_min=1e-3, dt_max=1e-1, implementation="fft"):
        if state_size < 2 or state_size % 2:
            raise ValueError(f"H3: state_size must be a positive even int (conjugate pairs), "
                             f"got {state_size}")
        if implementation not in ("fft", "recurrent"):
            raise ValueError(f"H3: implementation must be 'fft' or 'recurrent', got "
                             f"{implementation!r}")
        if shift_size < 1 or head_dim < 1 or dim % head_dim:
            raise ValueError(f"H3: need shift_size >= 1 and head_dim >= 1 dividing dim={dim}, "
                             f"got shift_size={shift_size}, head_dim={head_dim}")
        heads, n = dim // head_dim, state_size // 2
        ks = jax.random.split(key, 6)
        self.w_qkv = dense(ks[0], dim, 3 * dim)
        # The shift SSM's output matrix C: tap i reads the key i positions back.
        self.shift = jax.random.normal(ks[1], (heads, head_dim, shift_size)) / math.sqrt(
            shift_size)
        self.log_dt = log_uniform(ks[2], (heads,), dt_min, dt_max)
        self.log_a_re, self.a_im = s4d_lin((heads, n))
        self.b_re, self.b_im = jnp.ones((heads, n)), jnp.zeros((heads, n))
        self.c = jax.random.normal(ks[3], (2, heads, n)) * math.sqrt(0.5)
        self.d = jax.random.normal(ks[4], (heads,))
        self.w_out = dense(ks[5], dim, dim)
        self.causal, self.implementation = causal, implementation

    def system(self):
        """``(shift [H, P, S], dt [H], a, b, c [H, N/2] complex, d [H])``."""
        return (self.shift, jnp.exp(self.log_dt), -jnp.exp(self.log_a_re) + 1j * self.a_im,
                self.b_re + 1j * self.b_im, self.c[0] + 1j * self.c[1], self.d)

    def _qkv(self, x):
        heads, p = self.shift.shape[:2]
        qkv = x @ self.w_qkv.astype(x.dtype)
        return [t.reshape(*x.shape[:-1], heads, p) for t in jnp.split(qkv, 3, axis=-1)]

    def __call__(self, x, *, kv_mask=None, positions=None, key=None, segment_ids=None):
        x = check_mask("H3", x, kv_mask)
        q, k, v = self._qkv(x)
        system = self.system()

        def run(q, k, v, m, segment_ids=None):
            return M.h3(q, k, v, *system, kv_mask=m, segment_ids=segment_ids,
                        implementation=self.implementation)

        y = jax.vmap(lambda q, k, v, m, seg: both_ways(run, (q, k, v), m, self.causal, seg),
                     in_axes=(0, 0, 0, _axis(kv_mask), _axis(segment_ids)))(
            q, k, v, kv_mask, segment_ids)
        out = y.reshape(x.shape).astype(x.dtype) @ self.w_out.astype(x.dtype)
        return zero_padded(out, kv_mask)

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        _no_bidirectional_cache("H3", self.causal)
        one = M.h3_init_state(self.shift, self.a_im)
        return recurrent_cache(jax.tree.map(lambda s: jnp.zeros((batch, *s.shape), s.dtype), one))

    def decode(self, x, cache):
        q, k, v = (t[:, 0] for t in self._qkv(x))
        o, state = jax.vmap(M.h3_step, in_axes=(0, 0, 0, 0) + (None,) * 6)(
            cache.state, q, k, v, *self.system())
        out = o.reshape(x.shape[0], 1, -1).astype(x.dtype) @ self.w_out.astype(x.dtype)
        return out, type(cache)(state, cache.index + 1)


# The exponential decay window of the implicit filters (Poli et al. 2023, Section 3.3, as in
# their released ExponentialModulation): channel rates spread between the decay that reaches
# DECAY_TARGET at SLOW_DECAY and at FAST_DECAY of the normalised length.
DECAY_TARGET, FAST_DECAY, SLOW_DECAY = 1e-2, 0.3, 1.5


@implements("hyena")
class Hyena(MixerModule):
    """Hyena of order ``N`` (Poli et al. 2023): ``x W_in`` split into ``v, x_1 .. x_N`` after
    a short causal convolution (``short_width`` taps), ``z_{n+1} = x_n (h_n * z_n + b_n z_n)``
    by FFT convolutions, output projection. The long filters are implicit: ``h_n(t) =
    window(t) FFN(PE(t))`` with ``PE(t) = [t', cos(2 pi k t'), sin(2 pi k t')]``, ``t' = t /
    max_len``, ``k = 1 .. (emb_dim - 1) / 2``, an FFN of width ``filter_width`` with sine
    activations ``sin(omega z)`` (learned ``omega``, initialised to ``sine_freq``) and the
    exponential decay window ``exp(-alpha_d t')`` (rates fixed per channel). The filters are
    defined at every position, so sequences longer than ``max_len`` run (extrapolating).

    Decoding is a cache, not a recurrence (the paper gives none for implicit filters): every
    stage's past inputs, ``N D`` numbers per token (like a KV cache), and ``O(L D N)`` work per
    step; it equals the forward pass.

    Hyperparameters: ``order`` (N), ``filter_width``, ``emb_dim`` (odd), ``sine_freq``,
    ``short_width``.
    """

    w_in: jax.Array
    short_w: jax.Array
    short_b: jax.Array
    f_w1: jax.Array
    f_b1: jax.Array
    f_w2: jax.Array
    f_b2: jax.Array
    f_w3: jax.Array
    freq: jax.Array
    bias: jax.Array
    w_out: jax.Array
    max_len: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)

    def __init__(self, dim, num_heads, *, causal, max_len, key, order=2, filter_width=64,
                 emb_dim=33, sine_freq=1.0, short_width=3):
        if order < 1 or emb_dim < 3 or emb_dim % 2 == 0 or short_width < 1:
            raise ValueError(f"Hyena: need order >= 1, an odd emb_dim >= 3 and short_width >= "
                             f"1, got order={order}, emb_dim={emb_dim}, "
                             f"short_width={short_width}")
        ks = jax.random.split(key, 7)
        streams = (order + 1) * dim
        self.w_in = dense(ks[0], dim, streams)
        self.short_w = jax.random.uniform(ks[1], (short_width, streams), minval=-1,
                                          maxval=1) / math.sqrt(short_width)
        self.short_b = jnp.zeros((streams,))
        self.f_w1 = dense(ks[2], emb_dim, filter_width)
        self.f_b1 = jnp.zeros((filter_width,))
        self.f_w2 = dense(ks[3], filter_width, filter_width)
        self.f_b2 = jnp.zeros((filter_width,))
        self.f_w3 = dense(ks[4], filter_width, order * dim)
        self.freq = jnp.full((filter_width,), float(sine_freq))
        self.bias = jax.random.normal(ks[5], (order, dim))
        self.w_out = dense(ks[6], dim, dim)
        self.max_len, self.causal = max_len, causal

    def filters(self, length):
        """The long filters ``[N, D, length]`` (float32) at positions ``0 .. length - 1``."""
        order, dim = self.bias.shape
        t = jnp.arange(length, dtype=jnp.float32) / self.max_len
        bands = jnp.arange(1, (self.f_w1.shape[0] - 1) // 2 + 1, dtype=jnp.float32)
        angle = 2 * math.pi * t[:, None] * bands
        pe = jnp.concatenate([t[:, None], jnp.cos(angle), jnp.sin(angle)], -1)
        h = jnp.sin(self.freq * (pe @ self.f_w1 + self.f_b1))
        h = jnp.sin(self.freq * (h @ self.f_w2 + self.f_b2))
        h = (h @ self.f_w3).reshape(length, order, dim)
        rate = -math.log(DECAY_TARGET) / jnp.linspace(SLOW_DECAY, FAST_DECAY, dim)
        return jnp.transpose(h * jnp.exp(-t[:, None, None] * rate), (1, 2, 0))

    def __call__(self, x, *, kv_mask=None, positions=None, key=None, segment_ids=None):
        x = check_mask("Hyena", x, kv_mask)
        u = x @ self.w_in.astype(x.dtype)
        filters = self.filters(x.shape[1])

        def run(u, m, segment_ids=None):
            return M.hyena(u, self.short_w, self.short_b, filters, self.bias, kv_mask=m,
                           segment_ids=segment_ids)

        y = jax.vmap(lambda u, m, seg: both_ways(run, (u,), m, self.causal, seg),
                     in_axes=(0, _axis(kv_mask), _axis(segment_ids)))(u, kv_mask, segment_ids)
        return zero_padded(y.astype(x.dtype) @ self.w_out.astype(x.dtype), kv_mask)

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        """The short convolution's last inputs ``[B, W - 1, (N + 1) D]`` and every stage's past
        inputs ``[B, N, max_len, D]``."""
        _no_bidirectional_cache("Hyena", self.causal)
        order, dim = self.bias.shape
        return recurrent_cache((
            jnp.zeros((batch, self.short_w.shape[0] - 1, self.short_w.shape[1]), jnp.float32),
            jnp.zeros((batch, order, max_len, dim), jnp.float32)))

    def decode(self, x, cache):
        u = x[:, 0] @ self.w_in.astype(x.dtype)
        filters = self.filters(cache.state[1].shape[2])
        y, state = jax.vmap(M.hyena_step, in_axes=(0, 0) + (None,) * 5)(
            cache.state, u, cache.index, self.short_w, self.short_b, filters, self.bias)
        out = y[:, None].astype(x.dtype) @ self.w_out.astype(x.dtype)
        return out, type(cache)(state, cache.index + 1)
