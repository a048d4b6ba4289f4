"""Log-linear Mamba-2 (Guo et al., 2025, "Log-Linear Attention"): Mamba-2's layer with its
state per head replaced by the Fenwick-tree hierarchy of ``O(log L)`` states
(:func:`xformers_jax.mixers.loglinear_ssd`), read with level weights ``lambda_t^(l) =
softplus(x_t W_lambda + b_lambda)`` per head and level (the paper's per-level projection of
the input). ``b_lambda`` starts at ``softplus^-1(1)``, so at initialisation every level weighs 1
and the layer computes Mamba-2 with the same other parameters."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ... import mixers as M
from ...attention.linear import loglinear_step, num_levels
from .._slots import implements
from ._base import check_mask, dense, recurrent_cache, zero_padded
from ._recurrent import Mamba2, _conv_step, _per_head

_ONE = math.log(math.expm1(1.0))  # softplus^-1(1)


def _reversed_real_first(kv_mask, length):
    """The order that reads a row backwards starting from its last real token (its padding
    after): a bidirectional form's reverse pass whose Fenwick levels, like the forward pass's,
    do not depend on how much padding a row has."""
    t = jnp.arange(length)
    if kv_mask is None:
        return t[::-1]
    return jnp.argsort(jnp.where(kv_mask, -t, length + t))


@implements("loglinear_mamba2")
class LogLinearMamba2(Mamba2):
    """Mamba-2 with log-linear attention's hierarchy of states (Guo et al., 2025): the same
    projections, convolution, gate and norm, plus ``W_lambda [dim, H levels]``,
    ``b_lambda [H, levels]`` with ``levels = bit_length(max_len - 1) + 1``. Decoding keeps
    ``bit_length(max_len)`` states ``[N, P]`` per head. Hyperparameters: Mamba-2's
    (``chunk_size`` must be a power of two)."""

    w_lam: jax.Array
    b_lam: jax.Array
    max_len: int = eqx.field(static=True)

    def __init__(self, dim, num_heads, *, causal, max_len, key, state_size=64, expand=2,
                 conv_width=4, dt_min=1e-3, dt_max=1e-1, chunk_size=64,
                 implementation="chunked"):
        if chunk_size & (chunk_size - 1):
            raise ValueError(f"LogLinearMamba2: chunk_size must be a power of two (the Fenwick "
                             f"levels inside a chunk are those of its offsets), got {chunk_size}")
        key, sub = jax.random.split(key)
        super().__init__(dim, num_heads, causal=causal, max_len=max_len, key=key,
                         state_size=state_size, expand=expand, conv_width=conv_width,
                         dt_min=dt_min, dt_max=dt_max, chunk_size=chunk_size,
                         implementation=implementation)
        levels = num_levels(max_len)
        self.w_lam = dense(sub, dim, num_heads * levels) * 0.1
        self.b_lam = jnp.full((num_heads, levels), _ONE)
        self.max_len = max_len

    def _levels(self, x):
        """``lambda [B, L, H, levels]`` float32."""
        g = (x @ self.w_lam.astype(x.dtype)).astype(jnp.float32)
        g = g.reshape(*x.shape[:-1], *self.b_lam.shape)
        return jax.nn.softplus(g + self.b_lam)

    def _inputs(self, x, kv_mask):
        (xs, dt, a), shared, ctx = super()._inputs(x, kv_mask)
        return (xs, dt, a, self._levels(x)), shared, ctx

    def _one_way(self, xs, dt, a, lam, b, c, m):
        return M.loglinear_ssd(xs, dt, a[0], b, c, lam, kv_mask=m, **self._form())

    def _core(self, xs, dt, a, lam, b, c, m):
        out = self._one_way(xs, dt, a, lam, b, c, m)
        if self.causal:
            return out
        order = _reversed_real_first(m, xs.shape[0])
        back = self._one_way(*(t[order] for t in (xs, dt, a, lam, b, c)),
                             None if m is None else m[order])
        return out + jnp.zeros_like(back).at[order].set(back)

    def __call__(self, x, *, kv_mask=None, positions=None, key=None):
        x = check_mask(type(self).__name__, x, kv_mask)
        if x.shape[1] > self.max_len:
            raise ValueError(f"LogLinearMamba2: its level weights are sized for max_len="
                             f"{self.max_len} positions, got a sequence of {x.shape[1]} "
                             f"(x{tuple(x.shape)})")
        per_head, shared, ctx = self._inputs(x, kv_mask)
        # Both directions are in _core (the reverse pass reads the real tokens first).
        o = _per_head(self._core, True, per_head, shared, kv_mask=kv_mask)
        return zero_padded(self._out(x, o, ctx), kv_mask)

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        inner = self.norm_scale.shape[0]
        p = inner // self.num_heads
        n = max(max_len.bit_length(), 1)
        return recurrent_cache((
            jnp.zeros((batch, self.num_heads, n, self.state_size, p), jnp.float32),
            jnp.zeros((batch, self.conv_w.shape[0] - 1, self.conv_w.shape[1]), jnp.float32)))

    def decode(self, x, cache):
        ssm, buf = cache.state
        z, xbc, dt_raw = self._split(x)
        xbc_t, buf = _conv_step(buf, xbc[:, 0], self.conv_w, self.conv_b)
        xs, b, c, dt = self._heads_of(xbc_t[:, None], dt_raw)
        xs, b, c, dt = xs[:, 0].astype(jnp.float32), b[:, 0], c[:, 0], dt[:, 0]
        lam = self._levels(x)[:, 0]
        a = -jnp.exp(self.a_log)
        t = cache.index.astype(jnp.int32)

        def head(s, x_h, dt_h, a_h, lam_h, b_, c_):
            return loglinear_step(s, t, c_, b_, x_h * dt_h, dt_h * a_h, lam_h)

        step = jax.vmap(jax.vmap(head, in_axes=(0, 0, 0, 0, 0, None, None)),
                        in_axes=(0, 0, 0, None, 0, 0, 0))
        y, ssm = step(ssm, xs, dt, a, lam, b.astype(jnp.float32), c.astype(jnp.float32))
        return self._out(x, y[:, None], (xs[:, None], z)), type(cache)((ssm, buf), cache.index + 1)
