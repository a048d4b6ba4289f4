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
from .._slots import implements
from ._base import (MixerModule, check_mask, dense, log_uniform, recurrent_cache, s4d_lin,
                    zero_padded)


def _glu_out(x, y, w_out):
    h = jax.nn.gelu(y).astype(x.dtype) @ w_out.astype(x.dtype)
    a, g = jnp.split(h, 2, axis=-1)
    return a * jax.nn.sigmoid(g)


class _DiagonalSSM(MixerModule):
    """What S4D and S5 share: the parameters of a diagonal complex system ``Lambda = -exp(
    log_a_re) + i a_im`` (S4D-Lin: ``-1/2 + i pi n``), step sizes ``exp(log_dt)``
    log-uniform in ``[dt_min, dt_max]``, complex ``B``, ``C`` (and ``C'`` for the backward
    system when not causal, as ``[2, ...]`` real/imaginary pairs), the ``D`` skip and the GLU
    output; the block runs ``_run(u, *system, d, c_reverse=, kv_mask=, implementation=)``
    per sequence and decodes with ``_step``. A kind's ``system()`` returns ``_run``'s system
    arguments, ending with ``c`` and then ``c_reverse``."""

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

    def _init_system(self, key, keys, *, dim, dt_shape, a_shape, c_shape, c_std, dt_min,
                     dt_max, causal, implementation):
        """Everything but ``B``: ``keys`` draw ``log_dt``, ``C``, ``C'`` and ``D``."""
        k_dt, k_c, k_c_rev, k_d = keys
        self.log_dt = log_uniform(k_dt, dt_shape, dt_min, dt_max)
        self.log_a_re, self.a_im = s4d_lin(a_shape)
        self.c = jax.random.normal(k_c, (2, *c_shape)) * c_std
        self.c_reverse = None if causal else jax.random.normal(k_c_rev, (2, *c_shape)) * c_std
        self.d = jax.random.normal(k_d, (dim,))
        self.w_out = dense(jax.random.fold_in(key, 1), dim, 2 * dim)
        self.causal, self.implementation = causal, implementation

    def _lambda(self):
        return -jnp.exp(self.log_a_re) + 1j * self.a_im

    def _c_pair(self):
        cplx = lambda p: p[0] + 1j * p[1]  # noqa: E731
        return cplx(self.c), None if self.c_reverse is None else cplx(self.c_reverse)

    def __call__(self, x, *, kv_mask=None, positions=None, key=None, segment_ids=None):
        x = check_mask(type(self).__name__, x, kv_mask)
        *system, c_rev = self.system()
        # Packed rows (segment_ids [B, L]): S5 restarts its scan at a document, S4D convolves
        # within documents (the block checks Kind.segments).
        seg = {} if segment_ids is None else {"segment_ids": segment_ids}
        axes = {k: 0 for k in seg}
        y = jax.vmap(lambda u, m, kw: self._run(u, *system, self.d, c_reverse=c_rev,
                                                kv_mask=m, implementation=self.implementation,
                                                **kw),
                     in_axes=(0, None if kv_mask is None else 0, axes))(x, kv_mask, seg)
        return zero_padded(_glu_out(x, y, self.w_out), kv_mask)

    def decode(self, x, cache):
        *system, _ = self.system()
        y, s = jax.vmap(self._step, in_axes=(0, 0) + (None,) * (len(system) + 1))(
            cache.state, x[:, 0].astype(jnp.float32), *system, self.d)
        return _glu_out(x, y[:, None], self.w_out), type(cache)(s, cache.index + 1)


@implements("s4d")
class S4D(_DiagonalSSM):
    """S4D with S4D-Lin initialisation ``A_n = -1/2 + i pi n`` (N/2 conjugate pairs per
    channel). Hyperparameters: ``state_size`` (N, even), ``dt_min``, ``dt_max``,
    ``implementation`` (``"fft"`` or ``"recurrent"``)."""

    _run = staticmethod(M.s4d)
    _step = staticmethod(M.s4d_step)

    def __init__(self, dim, num_heads, *, causal, max_len, key, state_size=64, dt_min=1e-3,
                 dt_max=1e-1, implementation="fft"):
        if state_size < 2 or state_size % 2:
            raise ValueError(f"S4D: state_size must be a positive even int (conjugate pairs), "
                             f"got {state_size}")
        n = state_size // 2
        ks = jax.random.split(key, 4)
        self.b_re, self.b_im = jnp.ones((dim, n)), jnp.zeros((dim, n))
        # C ~ complex normal with variance 1 (real and imaginary parts of variance 1/2).
        self._init_system(key, ks, dim=dim, dt_shape=(dim,), a_shape=(dim, n),
                          c_shape=(dim, n), c_std=math.sqrt(0.5), dt_min=dt_min,
                          dt_max=dt_max, causal=causal, implementation=implementation)

    def system(self):
        """``(dt [H], a, b, c, c_reverse [H, N/2] complex)``."""
        c, c_rev = self._c_pair()
        return jnp.exp(self.log_dt), self._lambda(), self.b_re + 1j * self.b_im, c, c_rev

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        return recurrent_cache(jnp.zeros((batch, *self.a_im.shape), jnp.complex64))


@implements("s5")
class S5(_DiagonalSSM):
    """S5: one MIMO diagonal system of ``state_size`` complex states over all channels,
    ``Lambda`` initialised S4D-Lin (the paper diagonalises HiPPO-N; stated simplification),
    ``B, C`` complex Gaussian. Hyperparameters: ``state_size`` (P), ``dt_min``, ``dt_max``,
    ``implementation`` (``"associative"`` or ``"sequential"``)."""

    _run = staticmethod(M.s5)
    _step = staticmethod(M.s5_step)

    def __init__(self, dim, num_heads, *, causal, max_len, key, state_size=64, dt_min=1e-3,
                 dt_max=1e-1, implementation="associative"):
        p = state_size
        ks = jax.random.split(key, 6)
        self.b_re = jax.random.normal(ks[1], (p, dim)) / math.sqrt(2 * dim)
        self.b_im = jax.random.normal(ks[2], (p, dim)) / math.sqrt(2 * dim)
        self._init_system(key, (ks[0], ks[3], ks[4], ks[5]), dim=dim, dt_shape=(p,),
                          a_shape=(p,), c_shape=(dim, p), c_std=1 / math.sqrt(2 * p),
                          dt_min=dt_min, dt_max=dt_max, causal=causal,
                          implementation=implementation)

    def system(self):
        """``(lam [P], dt [P], b [P, H], c, c_reverse [H, P] complex)``."""
        c, c_rev = self._c_pair()
        return self._lambda(), jnp.exp(self.log_dt), self.b_re + 1j * self.b_im, c, c_rev

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        return recurrent_cache(jnp.zeros((batch, self.a_im.shape[0]), jnp.complex64))
