"""Modules of the recurrences since the surveys: xLSTM's mLSTM, HGRN2, Kimi Delta Attention,
RWKV-7 and (Gated) DeltaProduct, built as their siblings of :mod:`._recurrent` (project to
per-head arrays, the one-head function of :mod:`xformers_jax.mixers` over batch and heads,
per-head norm, output gate, out-projection; an O(1) state per head for decoding).

Simplifications, stated: no short convolutions before q/k/v (as GLA and Gated DeltaNet here);
the low-rank gate projections of Kimi Linear and RWKV-7 are single low-rank products; RWKV-7
omits token shift (its inputs are the block input itself) and the value residual across
layers; mLSTM is its cell inside this block (not the xLSTM up-projection block); HGRN2's
forget-gate lower bound is a per-layer hyperparameter rather than learned across layers.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ... import mixers as M
from ...attention.linear import causal_step
from ...mixers import DELTA_PRODUCT_CHUNK, DPLR_CHUNK, GLA_CHUNK
from .._slots import implements
from ._base import dense
from ._recurrent import _dt_bias, _head_norm, _heads, _QKVRecurrence, _rms

GATE_RANK = 16


def _l2(a):
    a = a.astype(jnp.float32)
    return a * jax.lax.rsqrt(jnp.sum(a * a, -1, keepdims=True) + 1e-6)


def _check_heads(name, dim, num_heads):
    if dim % num_heads:
        raise ValueError(f"{name}: dim={dim} is not divisible by num_heads={num_heads}")


@implements("mlstm")
class MLSTM(_QKVRecurrence):
    """The mLSTM cell of xLSTM (Beck et al. 2024): q, k (scaled by ``dk^-1/2``), v, per-head
    scalar input gates ``i~ = x W_i + b_i`` (exponential) and forget gates ``f~ = x W_f + b_f``
    (sigmoid; biases initialised to ``linspace(3, 6)`` as the paper's), the stabilised matrix
    memory, per-head group norm, sigmoid output gate ``o = sigmoid(x W_o)``, out-projection.
    Decodes with ``(C~, n~, m)`` per head. Hyperparameters: ``chunk_size``,
    ``implementation`` (``"chunked"``, ``"parallel"``, ``"recurrent"``)."""

    w_if: jax.Array
    b_if: jax.Array
    wg: jax.Array
    wo: jax.Array

    def __init__(self, dim, num_heads, *, causal, max_len, key, chunk_size=64,
                 implementation="chunked", short_conv=0):
        _check_heads("MLSTM", dim, num_heads)
        ks = jax.random.split(key, 6)
        self._init_qkv(ks, dim, dim)
        self._init_conv(jax.random.fold_in(key, 2), short_conv)
        self.wg, self.wo = dense(ks[3], dim, dim), dense(ks[4], dim, dim)
        self.w_if = dense(ks[5], dim, 2 * num_heads) * 0.1
        self.b_if = jnp.concatenate([jnp.zeros((num_heads,)),
                                     jnp.linspace(3.0, 6.0, num_heads)])
        self._settings(num_heads, causal, chunk_size, implementation)

    def _project(self, x, segment_ids=None, qkv=None):
        q, k, v = self._qkv(x, segment_ids, qkv)
        gates = (x @ self.w_if.astype(x.dtype)).astype(jnp.float32) + self.b_if
        h = self.num_heads
        return q, k / math.sqrt(k.shape[-1]), v, gates[..., :h], gates[..., h:]

    def _core(self, q, k, v, i, f, m, segment_ids=None):
        return M.mlstm(q, k, v, i, f, kv_mask=m, segment_ids=segment_ids, **self._form())

    def _step(self, state, q, k, v, i, f):
        return M.mlstm_step(state, q, k, v, i, f)

    _norm = staticmethod(_head_norm)

    def _gate_weight(self):
        return self.wg

    def _out(self, x, o, ctx=None):
        o = self._norm(o).reshape(x.shape).astype(x.dtype)
        gate = jax.nn.sigmoid(x @ self.wg.astype(x.dtype))
        return (gate * o) @ self.wo.astype(x.dtype)

    def _init_state(self, batch):
        h = self.num_heads
        dk, dv = self.wq.shape[1] // h, self.wv.shape[1] // h
        c, n, m = M.mlstm_init_state(dk, dv)
        return tuple(jnp.broadcast_to(a, (batch, h, *a.shape)) for a in (c, n, m))


@implements("hgrn2")
class HGRN2(_QKVRecurrence):
    """HGRN2 (Qin et al. 2024): per head, the output gate read as a query ``q = x W_q``, forget
    gates ``f = lb + (1 - lb) sigmoid(x W_f)`` of the head's key width, the input ``v = x W_v``;
    ``S_t = diag(f_t) S_{t-1} + (1 - f_t) v_t^T``, ``o_t = q_t^T S_t`` (GLA's chunked scan);
    per-head RMS norm, swish output gate, out-projection. Hyperparameters: ``lower_bound``
    (``lb``), ``chunk_size`` (default 16), ``implementation``."""

    wr: jax.Array
    wo: jax.Array
    lower_bound: float = eqx.field(static=True)

    def __init__(self, dim, num_heads, *, causal, max_len, key, lower_bound=0.0,
                 chunk_size=GLA_CHUNK, implementation="chunked"):
        _check_heads("HGRN2", dim, num_heads)
        if not 0.0 <= lower_bound < 1.0:
            raise ValueError(f"HGRN2: lower_bound must be in [0, 1), got {lower_bound}")
        ks = jax.random.split(key, 5)
        self._init_qkv(ks, dim, dim)  # wk: the forget gates' projection
        self.wr, self.wo = dense(ks[3], dim, dim), dense(ks[4], dim, dim)
        self.lower_bound = float(lower_bound)
        self._settings(num_heads, causal, chunk_size, implementation)

    def _project(self, x, segment_ids=None, qkv=None):
        q, f, v = self._qkv(x, qkv=qkv)
        lb = self.lower_bound
        # log(lb + (1 - lb) sigmoid(z)) without leaving log space when lb = 0.
        log_f = jax.nn.log_sigmoid(f.astype(jnp.float32))
        if lb:
            log_f = jnp.logaddexp(math.log(lb), math.log1p(-lb) + log_f)
        return q, -jnp.expm1(log_f), v, log_f

    def _core(self, q, fk, v, log_f, m, segment_ids=None):
        return M.hgrn2(q, v, log_f, kv_mask=m, segment_ids=segment_ids, **self._form())

    _step = staticmethod(causal_step)
    _norm = staticmethod(_rms)

    def _gate_weight(self):
        return self.wr


class _LowRankDecay:
    """Per-channel log-decays ``-exp(a_log_h) softplus(x W1 W2 + dt_bias)`` (Mamba-2's decay with
    a low-rank, per-channel argument, as Kimi Linear's)."""

    @staticmethod
    def make(key, dim, num_heads, dt_min, dt_max):
        ks = jax.random.split(key, 4)
        return (dense(ks[0], dim, GATE_RANK), dense(ks[1], GATE_RANK, dim),
                jnp.log(jax.random.uniform(ks[2], (num_heads,), minval=1, maxval=16)),
                _dt_bias(ks[3], (dim,), dt_min, dt_max))


@implements("kda")
class KimiDeltaAttention(_QKVRecurrence):
    """Kimi Delta Attention (Kimi Linear, 2025): SiLU then L2-normalised q, k per head,
    ``beta = sigmoid(x W_beta)`` per head, per-channel decays ``log alpha = -exp(a_log_h)
    softplus(x W_a1 W_a2 + dt_bias)``, the per-channel gated delta rule, per-head RMS norm,
    a sigmoid output gate, out-projection. Hyperparameters: ``chunk_size`` (default
    ``mixers.DPLR_CHUNK``, 8), ``implementation``, ``dt_min``, ``dt_max``."""

    w_beta: jax.Array
    w_a1: jax.Array
    w_a2: jax.Array
    a_log: jax.Array
    dt_bias: jax.Array
    wg: jax.Array
    wo: jax.Array

    def __init__(self, dim, num_heads, *, causal, max_len, key, chunk_size=DPLR_CHUNK,
                 implementation="chunked", dt_min=1e-3, dt_max=1e-1, short_conv=0):
        _check_heads("KimiDeltaAttention", dim, num_heads)
        ks = jax.random.split(key, 7)
        self._init_qkv(ks, dim, dim)
        self._init_conv(jax.random.fold_in(key, 2), short_conv)
        self.wg, self.wo = dense(ks[3], dim, dim), dense(ks[4], dim, dim)
        self.w_beta = dense(ks[5], dim, num_heads)
        self.w_a1, self.w_a2, self.a_log, self.dt_bias = _LowRankDecay.make(
            ks[6], dim, num_heads, dt_min, dt_max)
        self._settings(num_heads, causal, chunk_size, implementation)

    def _project(self, x, segment_ids=None, qkv=None):
        dt = x.dtype
        q, k, v = self._qkv(x, segment_ids, qkv)
        q, k = (_l2(jax.nn.silu(a)) for a in (q, k))
        beta = jax.nn.sigmoid((x @ self.w_beta.astype(dt)).astype(jnp.float32))
        z = ((x @ self.w_a1.astype(dt)) @ self.w_a2.astype(dt)).astype(jnp.float32)
        ld = _heads(jax.nn.softplus(z + self.dt_bias), self.num_heads)
        return q, k, v, beta, -jnp.exp(self.a_log)[:, None] * ld

    def _core(self, q, k, v, beta, ld, m, segment_ids=None):
        return M.kda(q, k, v, beta, ld, kv_mask=m, segment_ids=segment_ids, **self._form())

    _step = staticmethod(M.kda_step)
    _norm = staticmethod(_rms)

    def _out(self, x, o, ctx=None):
        o = self._norm(o).reshape(x.shape).astype(x.dtype)
        return (jax.nn.sigmoid(x @ self.wg.astype(x.dtype)) * o) @ self.wo.astype(x.dtype)


@implements("rwkv7")
class RWKV7(_QKVRecurrence):
    """RWKV-7 time mixing (Peng et al. 2025): receptance ``r``, key ``k`` and value ``v``
    projections; decays ``w = exp(-exp(-1/2) sigmoid(x W_w1 W_w2 + b_w))`` per channel (in
    ``(e^-0.61, 1)``); in-context learning rates ``a = sigmoid(x W_a1 W_a2 + b_a)``; removal
    keys ``kappa = normalise(k * xi)``, replacement keys ``k * (1 + (a - 1) alpha)`` with learned
    per-channel ``xi`` and ``alpha``; the bonus ``u``; per-head group norm; swish output gate.
    Hyperparameters: ``chunk_size`` (default ``mixers.DPLR_CHUNK``, 8), ``implementation``."""

    w_w1: jax.Array
    w_w2: jax.Array
    b_w: jax.Array
    w_a1: jax.Array
    w_a2: jax.Array
    b_a: jax.Array
    k_removal: jax.Array
    k_rate: jax.Array
    bonus: jax.Array
    wg: jax.Array
    wo: jax.Array

    def __init__(self, dim, num_heads, *, causal, max_len, key, chunk_size=DPLR_CHUNK,
                 implementation="chunked"):
        _check_heads("RWKV7", dim, num_heads)
        ks = jax.random.split(key, 10)
        self._init_qkv(ks, dim, dim)
        self.wg, self.wo = dense(ks[3], dim, dim), dense(ks[4], dim, dim)
        self.w_w1, self.w_w2 = dense(ks[5], dim, GATE_RANK), dense(ks[6], GATE_RANK, dim) * 0.1
        self.b_w = jnp.zeros((dim,))
        self.w_a1, self.w_a2 = dense(ks[7], dim, GATE_RANK), dense(ks[8], GATE_RANK, dim) * 0.1
        self.b_a = jnp.zeros((dim,))
        self.k_removal = jnp.ones((dim,))
        self.k_rate = jnp.zeros((dim,))
        self.bonus = jax.random.normal(ks[9], (dim,)) * 0.1
        self._settings(num_heads, causal, chunk_size, implementation)

    def _project(self, x, segment_ids=None, qkv=None):
        dt, h = x.dtype, self.num_heads
        r, k, v = self._qkv(x, qkv=qkv)
        low = lambda w1, w2, b: ((x @ w1.astype(dt)) @ w2.astype(dt)).astype(  # noqa: E731
            jnp.float32) + b
        log_w = -math.exp(-0.5) * jax.nn.sigmoid(low(self.w_w1, self.w_w2, self.b_w))
        a = jax.nn.sigmoid(low(self.w_a1, self.w_a2, self.b_a))
        k = k.astype(jnp.float32)
        per_head = lambda p: p.reshape(h, -1)  # noqa: E731
        kappa = _l2(k * per_head(self.k_removal))
        a = _heads(a, h)
        k = k * (1 + (a - 1) * per_head(self.k_rate))
        u = jnp.broadcast_to(per_head(self.bonus), k.shape)
        return r, k, v, _heads(log_w, h), kappa, a, u

    def _core(self, r, k, v, log_w, kappa, a, u, m, segment_ids=None):
        return M.rwkv7(r, k, v, log_w, kappa, a, u[0], kv_mask=m, segment_ids=segment_ids,
                       **self._form())

    _step = staticmethod(M.rwkv7_step)
    _norm = staticmethod(_head_norm)

    def _gate_weight(self):
        return self.wg


@implements("delta_product")
class GatedDeltaProduct(_QKVRecurrence):
    """Gated DeltaProduct (Siems et al. 2025): ``n_h`` keys, values and write strengths per
    token and head (SiLU then L2-normalised keys; ``beta = 2 sigmoid(x W_beta)`` in ``(0, 2)``,
    allowing negative eigenvalues), Mamba-2's scalar decay once per token, ``n_h`` delta steps,
    per-head RMS norm, swish output gate. Hyperparameters: ``householder_steps`` (``n_h``),
    ``chunk_size`` (sub-steps per chunk), ``implementation``, ``dt_min``, ``dt_max``."""

    w_beta: jax.Array
    w_a: jax.Array
    a_log: jax.Array
    dt_bias: jax.Array
    wg: jax.Array
    wo: jax.Array

    def __init__(self, dim, num_heads, *, causal, max_len, key, householder_steps=2,
                 chunk_size=DELTA_PRODUCT_CHUNK, implementation="chunked", dt_min=1e-3,
                 dt_max=1e-1, short_conv=0):
        _check_heads("GatedDeltaProduct", dim, num_heads)
        if not isinstance(householder_steps, int) or householder_steps < 1:
            raise ValueError(f"GatedDeltaProduct: householder_steps must be a positive int, "
                             f"got {householder_steps!r}")
        ks = jax.random.split(key, 8)
        nh = householder_steps
        self.wq = dense(ks[0], dim, dim)
        self.wk, self.wv = dense(ks[1], dim, nh * dim), dense(ks[2], dim, nh * dim)
        self.wg, self.wo = dense(ks[3], dim, dim), dense(ks[4], dim, dim)
        self.w_beta = dense(ks[5], dim, nh * num_heads)
        self.w_a = dense(ks[6], dim, num_heads)
        self.a_log = jnp.log(jax.random.uniform(ks[7], (num_heads,), minval=1, maxval=16))
        self.dt_bias = _dt_bias(jax.random.fold_in(key, 1), (num_heads,), dt_min, dt_max)
        self._init_conv(jax.random.fold_in(key, 2), short_conv)
        self._settings(num_heads, causal, chunk_size, implementation)

    def _steps(self):
        return self.wk.shape[1] // self.wq.shape[1]

    def _project(self, x, segment_ids=None, qkv=None):
        dt, h, nh = x.dtype, self.num_heads, self._steps()
        b, length, _ = x.shape

        def per_step(a):  # [B, L, nh * dim] -> [B, L, H, nh, dim / H]
            return jnp.moveaxis(a.reshape(b, length, nh, h, -1), 2, 3)

        q, k, v = self._conv_qkv(x, segment_ids, qkv)
        q = _l2(jax.nn.silu(_heads(q, h)))
        k = _l2(jax.nn.silu(per_step(k)))
        v = per_step(v)
        beta = 2 * jax.nn.sigmoid((x @ self.w_beta.astype(dt)).astype(jnp.float32))
        beta = jnp.moveaxis(beta.reshape(b, length, nh, h), 2, 3)
        ld = -jnp.exp(self.a_log) * jax.nn.softplus(
            (x @ self.w_a.astype(dt)).astype(jnp.float32) + self.dt_bias)
        return q, k, v, beta, ld

    def _core(self, q, k, v, beta, ld, m, segment_ids=None):
        return M.delta_product(q, k, v, beta, ld, kv_mask=m, segment_ids=segment_ids,
                               **self._form())

    _step = staticmethod(M.delta_product_step)
    _norm = staticmethod(_rms)

    def _gate_weight(self):
        return self.wg

    def _init_state(self, batch):
        h = self.num_heads
        d = self.wq.shape[1] // h
        return jnp.zeros((batch, h, d, d), jnp.float32)
