"""Modules of the diagonal state space models S4D and S5.

Both follow the S4 block (Gu et al. 2022): the SSM per channel (S4D) or across channels (S5),
the ``D`` skip, GELU, then a linear map to ``2 dim`` and a GLU. Without ``causal`` a second
output matrix reads the system run backwards (the bidirectional form for classification).
``dt_min`` / ``dt_max`` bound the log-uniform initial step sizes (the published LRA results
depend on them); the SSM parameters (``log_dt``, ``log_a_re``, ``a_im``, ``b_re``, ``b_im``)
get their own learning rate and no weight decay in the trainer (``train.make_optimizer``).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ... import mixers as M
from ._registry import MixerModule, check_mask, dense, log_uniform, recurrent_cache, zero_padded


def _glu_out(x, y, w_out):
    h = jax.nn.gelu(y).astype(x.dtype) @ w_out.astype(x.dtype)
    a, g = jnp.split(h, 2, axis=-1)
    return a * jax.nn.sigmoid(g)


class S4D(MixerModule):
    """S4D with S4D-Lin initialisation ``A_n = -1/2 + i pi n`` (N/2 conjugate pairs per
    channel). Hyperparameters: ``state_size`` (N, even), ``dt_min``, ``dt_max``,
    ``implementation`` (``"fft"`` or ``"recurrent"``)."""

    log_dt: jax.Array
    log_a_re: jax.Array
    a_im: jax.Array
    b_re: jax.Array
    b_im: jax.Array
    c: jax.Array
    c_reverse: jax.Array | None
    d: jax.Array
    w_out: jax.Array
    causal: bool = eqx.field(static=True)
    implementation: str = eqx.field(static=True)

    def __init__(self, dim, num_heads, *, causal, max_len, key, state_size=64, dt_min=1e-3,
                 dt_max=1e-1, implementation="fft"):
        if state_size < 2 or state_size % 2:
            raise ValueError(f"S4D: state_size must be a positive even int (conjugate pairs), "
                             f"got {state_size}")
        n = state_size // 2
        ks = jax.random.split(key, 4)
        self.log_dt = log_uniform(ks[0], (dim,), dt_min, dt_max)
        self.log_a_re = jnp.full((dim, n), math.log(0.5))
        self.a_im = jnp.broadcast_to(math.pi * jnp.arange(n, dtype=jnp.float32), (dim, n))
        self.b_re, self.b_im = jnp.ones((dim, n)), jnp.zeros((dim, n))
        # C ~ complex normal with variance 1 (real and imaginary parts of variance 1/2).
        self.c = jax.random.normal(ks[1], (2, dim, n)) * math.sqrt(0.5)
        self.c_reverse = None if causal else jax.random.normal(ks[2], (2, dim, n)) * math.sqrt(0.5)
        self.d = jax.random.normal(ks[3], (dim,))
        self.w_out = dense(jax.random.fold_in(key, 1), dim, 2 * dim)
        self.causal, self.implementation = causal, implementation

    def system(self):
        """``(dt [H], a, b, c, c_reverse [H, N/2] complex)``."""
        cplx = lambda p: p[0] + 1j * p[1]  # noqa: E731
        a = -jnp.exp(self.log_a_re) + 1j * self.a_im
        c_rev = None if self.c_reverse is None else cplx(self.c_reverse)
        return jnp.exp(self.log_dt), a, self.b_re + 1j * self.b_im, cplx(self.c), c_rev

    def __call__(self, x, *, kv_mask=None, positions=None, key=None):
        check_mask("S4D", x, kv_mask)
        dt, a, b, c, c_rev = self.system()
        y = jax.vmap(lambda u, m: M.s4d(u, dt, a, b, c, self.d, c_reverse=c_rev, kv_mask=m,
                                        implementation=self.implementation),
                     in_axes=(0, None if kv_mask is None else 0))(x, kv_mask)
        return zero_padded(_glu_out(x, y, self.w_out), kv_mask)

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        return recurrent_cache(jnp.zeros((batch, *self.a_im.shape), jnp.complex64))

    def decode(self, x, cache):
        dt, a, b, c, _ = self.system()
        y, s = jax.vmap(M.s4d_step, in_axes=(0, 0, None, None, None, None, None))(
            cache.state, x[:, 0].astype(jnp.float32), dt, a, b, c, self.d)
        return _glu_out(x, y[:, None], self.w_out), type(cache)(s, cache.index + 1)


class S5(MixerModule):
    """S5: one MIMO diagonal system of ``state_size`` complex states over all channels,
    ``Lambda`` initialised S4D-Lin (the paper diagonalises HiPPO-N; stated simplification),
    ``B, C`` complex Gaussian. Hyperparameters: ``state_size`` (P), ``dt_min``, ``dt_max``,
    ``implementation`` (``"associative"`` or ``"sequential"``)."""

    log_dt: jax.Array
    log_a_re: jax.Array
    a_im: jax.Array
    b_re: jax.Array
    b_im: jax.Array
    c: jax.Array
    c_reverse: jax.Array | None
    d: jax.Array
    w_out: jax.Array
    causal: bool = eqx.field(static=True)
    implementation: str = eqx.field(static=True)

    def __init__(self, dim, num_heads, *, causal, max_len, key, state_size=64, dt_min=1e-3,
                 dt_max=1e-1, implementation="associative"):
        p = state_size
        ks = jax.random.split(key, 6)
        self.log_dt = log_uniform(ks[0], (p,), dt_min, dt_max)
        self.log_a_re = jnp.full((p,), math.log(0.5))
        self.a_im = math.pi * jnp.arange(p, dtype=jnp.float32)
        self.b_re = jax.random.normal(ks[1], (p, dim)) / math.sqrt(2 * dim)
        self.b_im = jax.random.normal(ks[2], (p, dim)) / math.sqrt(2 * dim)
        self.c = jax.random.normal(ks[3], (2, dim, p)) / math.sqrt(2 * p)
        self.c_reverse = None if causal else jax.random.normal(ks[4], (2, dim, p)) / math.sqrt(
            2 * p)
        self.d = jax.random.normal(ks[5], (dim,))
        self.w_out = dense(jax.random.fold_in(key, 1), dim, 2 * dim)
        self.causal, self.implementation = causal, implementation

    def system(self):
        cplx = lambda p: p[0] + 1j * p[1]  # noqa: E731
        lam = -jnp.exp(self.log_a_re) + 1j * self.a_im
        c_rev = None if self.c_reverse is None else cplx(self.c_reverse)
        return lam, jnp.exp(self.log_dt), self.b_re + 1j * self.b_im, cplx(self.c), c_rev

    def __call__(self, x, *, kv_mask=None, positions=None, key=None):
        check_mask("S5", x, kv_mask)
        lam, dt, b, c, c_rev = self.system()
        y = jax.vmap(lambda u, m: M.s5(u, lam, dt, b, c, self.d, c_reverse=c_rev, kv_mask=m,
                                       implementation=self.implementation),
                     in_axes=(0, None if kv_mask is None else 0))(x, kv_mask)
        return zero_padded(_glu_out(x, y, self.w_out), kv_mask)

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        return recurrent_cache(jnp.zeros((batch, self.a_im.shape[0]), jnp.complex64))

    def decode(self, x, cache):
        lam, dt, b, c, _ = self.system()
        y, s = jax.vmap(M.s5_step, in_axes=(0, 0, None, None, None, None, None))(
            cache.state, x[:, 0].astype(jnp.float32), lam, dt, b, c, self.d)
        return _glu_out(x, y[:, None], self.w_out), type(cache)(s, cache.index + 1)
