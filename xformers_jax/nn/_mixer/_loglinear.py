"""Log-linear attention's layers (Guo et al., 2025, "Log-Linear Attention"): Mamba-2's layer
and a linear-attention layer with the state per head replaced by the Fenwick-tree hierarchy of
``O(log L)`` states (:func:`xformers_jax.mixers.loglinear_ssd`,
:func:`xformers_jax.mixers.loglinear_linear`), read with level weights ``lambda_t^(l) =
softplus(x_t W_lambda + b_lambda)`` per head and level (the paper's per-level projection of
the input). ``b_lambda`` starts at ``softplus^-1(1)`` and ``W_lambda`` small, so at
initialisation every level weighs about 1 and each layer is close to its base.

The bidirectional forms (``causal=False``) add a reverse pass that reads each row from its
last real token backwards, so that, like the forward pass's, its Fenwick levels do not depend
on how much padding follows a row."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ... import mixers as M
from ...attention.linear import loglinear_step, num_levels
from .._slots import implements
from ._base import check_mask, dense, recurrent_cache, zero_padded
from ._recurrent import Mamba2, _conv_step, _per_head, _QKVRecurrence, _rms

_ONE = math.log(math.expm1(1.0))  # softplus^-1(1)


def _reversed_real_first(kv_mask, length):
    """The order that reads a row backwards starting from its last real token (its padding
    after): a bidirectional form's reverse pass whose Fenwick levels, like the forward pass's,
    do not depend on how much padding a row has."""
    t = jnp.arange(length)
    if kv_mask is None:
        return t[::-1]
    return jnp.argsort(jnp.where(kv_mask, -t, length + t))


def _one_and_reverse(fn, arrays, m, causal):
    """``fn(*arrays, m)``, plus (not causal) the pass read from the last real token back."""
    out = fn(*arrays, m)
    if causal:
        return out
    order = _reversed_real_first(m, arrays[0].shape[0])
    back = fn(*(t[order] for t in arrays), None if m is None else m[order])
    return out + jnp.zeros_like(back).at[order].set(back)


def _init_levels(layer, key, dim, num_heads, max_len):
    levels = num_levels(max_len)
    layer.w_lam = dense(key, dim, num_heads * levels) * 0.1
    layer.b_lam = jnp.full((num_heads, levels), _ONE)
    layer.max_len = max_len


def _level_weights(layer, x):
    """``lambda [B, L, H, levels]`` float32."""
    g = (x @ layer.w_lam.astype(x.dtype)).astype(jnp.float32)
    return jax.nn.softplus(g.reshape(*x.shape[:-1], *layer.b_lam.shape) + layer.b_lam)


def _call(layer, x, kv_mask):
    x = check_mask(type(layer).__name__, x, kv_mask)
    if x.shape[1] > layer.max_len:
        raise ValueError(f"{type(layer).__name__}: its level weights are sized for max_len="
                         f"{layer.max_len} positions, got a sequence of {x.shape[1]} "
                         f"(x{tuple(x.shape)})")
    per_head, shared, ctx = layer._inputs(x, kv_mask)
    # Both directions are in _core (the reverse pass reads the real tokens first).
    o = _per_head(layer._core, True, per_head, shared, kv_mask=kv_mask)
    return zero_padded(layer._out(x, o, ctx), kv_mask)


def _check_cache(layer, max_len):
    if max_len > layer.max_len:
        raise ValueError(f"{type(layer).__name__}.init_cache: its level weights are sized for "
                         f"max_len={layer.max_len} positions, so it cannot decode {max_len}")
    return max(max_len.bit_length(), 1)


def _check_chunk(name, chunk_size):
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"{name}: chunk_size must be a power of two (the Fenwick levels inside "
                         f"a chunk are those of its offsets), got {chunk_size}")


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
                 conv_width=4, dt_min=1e-3, dt_max=1e-1, chunk_size=M.LOGLINEAR_CHUNK,
                 implementation="chunked"):
        _check_chunk("LogLinearMamba2", chunk_size)
        key, sub = jax.random.split(key)
        super().__init__(dim, num_heads, causal=causal, max_len=max_len, key=key,
                         state_size=state_size, expand=expand, conv_width=conv_width,
                         dt_min=dt_min, dt_max=dt_max, chunk_size=chunk_size,
                         implementation=implementation)
        _init_levels(self, sub, dim, num_heads, max_len)

    def _inputs(self, x, kv_mask):
        (xs, dt, a), shared, ctx = super()._inputs(x, kv_mask)
        return (xs, dt, a, _level_weights(self, x)), shared, ctx

    def _one_way(self, xs, dt, a, lam, b, c, m):
        return M.loglinear_ssd(xs, dt, a[0], b, c, lam, kv_mask=m, **self._form())

    def _core(self, xs, dt, a, lam, b, c, m):
        return _one_and_reverse(self._one_way, (xs, dt, a, lam, b, c), m, self.causal)

    def __call__(self, x, *, kv_mask=None, positions=None, key=None):
        return _call(self, x, kv_mask)

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        inner = self.norm_scale.shape[0]
        p = inner // self.num_heads
        n = _check_cache(self, max_len)
        return recurrent_cache((
            jnp.zeros((batch, self.num_heads, n, self.state_size, p), jnp.float32),
            jnp.zeros((batch, self.conv_w.shape[0] - 1, self.conv_w.shape[1]), jnp.float32)))

    def decode(self, x, cache):
        ssm, buf = cache.state
        z, xbc, dt_raw = self._split(x)
        xbc_t, buf = _conv_step(buf, xbc[:, 0], self.conv_w, self.conv_b)
        xs, b, c, dt = self._heads_of(xbc_t[:, None], dt_raw)
        xs, b, c, dt = xs[:, 0].astype(jnp.float32), b[:, 0], c[:, 0], dt[:, 0]
        lam = _level_weights(self, x)[:, 0]
        a = -jnp.exp(self.a_log)
        t = cache.index.astype(jnp.int32)

        def head(s, x_h, dt_h, a_h, lam_h, b_, c_):
            return loglinear_step(s, t, c_, b_, x_h * dt_h, dt_h * a_h, lam_h)

        step = jax.vmap(jax.vmap(head, in_axes=(0, 0, 0, 0, 0, None, None)),
                        in_axes=(0, 0, 0, None, 0, 0, 0))
        y, ssm = step(ssm, xs, dt, a, lam, b.astype(jnp.float32), c.astype(jnp.float32))
        return self._out(x, y[:, None], (xs[:, None], z)), type(cache)((ssm, buf), cache.index + 1)


@implements("loglinear_linear")
class LogLinearLinear(_QKVRecurrence):
    """Log-linear linear attention (Guo et al., 2025) in the layer of this library's linear
    recurrences (as RetNet's and GLA's): q, k, v projections (``k / sqrt(d_k)``), the
    hierarchy of states per head with level weights ``softplus(x W_lambda + b_lambda)``,
    per-head RMS norm, swish output gate, out-projection. Decoding keeps ``bit_length(max_len)``
    states ``[d_k, d_v]`` per head. Hyperparameters: ``chunk_size`` (a power of two),
    ``implementation``."""

    wg: jax.Array
    wo: jax.Array
    w_lam: jax.Array
    b_lam: jax.Array
    max_len: int = eqx.field(static=True)

    def __init__(self, dim, num_heads, *, causal, max_len, key, chunk_size=M.LOGLINEAR_CHUNK,
                 implementation="chunked"):
        if dim % num_heads:
            raise ValueError(f"LogLinearLinear: dim={dim} is not divisible by "
                             f"num_heads={num_heads}")
        _check_chunk("LogLinearLinear", chunk_size)
        ks = jax.random.split(key, 6)
        self._init_qkv(ks, dim, dim)
        self.wg, self.wo = dense(ks[3], dim, dim), dense(ks[4], dim, dim)
        _init_levels(self, ks[5], dim, num_heads, max_len)
        self._settings(num_heads, causal, chunk_size, implementation)

    def _project(self, x, segment_ids=None):
        q, k, v = self._qkv(x)
        return q, k / math.sqrt(q.shape[-1]), v, _level_weights(self, x)

    def _one_way(self, q, k, v, lam, m):
        return M.loglinear_linear(q, k, v, lam, kv_mask=m, **self._form())

    def _core(self, q, k, v, lam, m):
        return _one_and_reverse(self._one_way, (q, k, v, lam), m, self.causal)

    _norm = staticmethod(_rms)

    def _gate_weight(self):
        return self.wg

    def __call__(self, x, *, kv_mask=None, positions=None, key=None):
        return _call(self, x, kv_mask)

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        h = self.num_heads
        dk, dv = self.wq.shape[1] // h, self.wv.shape[1] // h
        n = _check_cache(self, max_len)
        return recurrent_cache(jnp.zeros((batch, h, n, dk, dv), jnp.float32))

    def decode(self, x, cache):
        q, k, v, lam = (a[:, 0].astype(jnp.float32) for a in self._project(x))
        t = cache.index.astype(jnp.int32)

        def head(s, q_h, k_h, v_h, lam_h):
            return loglinear_step(s, t, q_h, k_h, v_h, jnp.float32(0), lam_h)

        o, s = jax.vmap(jax.vmap(head))(cache.state, q, k, v, lam)
        return self._out(x, o[:, None]), type(cache)(s, cache.index + 1)
