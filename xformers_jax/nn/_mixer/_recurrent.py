"""Modules of the gated linear recurrences: RetNet, GLA, Mamba-2, Mamba, Gated DeltaNet.

Each projects ``x [B, L, dim]`` to its per-head arrays, runs the one-sequence function of
:mod:`xformers_jax.mixers` (vmapped over batch and heads), and decodes with an O(1) state per
head through the same recurrence's step. Without ``causal`` the recurrence also runs from the
last position (the bidirectional form; sum of the two directions).

Simplifications, stated: RetNet omits xPos (rotary positions can be added on the embeddings);
GLA and Gated DeltaNet omit the short convolutions before q/k/v; Mamba and Mamba-2 keep theirs
(width 4, depthwise, causal), run forwards in the bidirectional form too.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ... import mixers as M
from ...attention.linear import causal_step, gated_delta_step
from ...mixers import GLA_CHUNK, selective_step
from ...mixers import causal_depthwise_conv as _causal_conv
from ...mixers import causal_depthwise_step as _conv_step
from .._slots import implements
from ._base import (MixerModule, both_ways, check_mask, dense, log_uniform, recurrent_cache,
                        zero_padded)

_RECURRENT_HP = frozenset({"chunk_size", "implementation"})


def _heads(x, num_heads):
    b, length, _ = x.shape
    return x.reshape(b, length, num_heads, -1)


def _per_head(fn, causal, arrays, shared=(), kv_mask=None, segment_ids=None):
    """``fn(*one_head_arrays, *shared_arrays, kv_mask)`` vmapped over batch (axis 0) and heads
    (axis 2 of the ``[B, L, H, ...]`` ``arrays``; the ``[B, L, ...]`` ``shared`` arrays are
    the same for every head); with ``segment_ids int[B, L]`` (packed rows) ``fn`` also takes
    ``segment_ids=`` (one sequence's)."""
    def one(*a_m_s):
        *a, m, seg = a_m_s
        return both_ways(fn, a, m, causal, seg)

    n, k = len(arrays), len(shared)
    head_axes = (1,) * n + (None,) * (k + 2)
    batch_axes = ((0,) * (n + k) + (None if kv_mask is None else 0,)
                  + (None if segment_ids is None else 0,))
    f = jax.vmap(jax.vmap(one, in_axes=head_axes, out_axes=1), in_axes=batch_axes)
    return f(*arrays, *shared, kv_mask, segment_ids)


def _head_norm(o, eps=1e-5):
    """Per-head normalisation without parameters (RetNet's GroupNorm over each head)."""
    o = o.astype(jnp.float32)
    mu = o.mean(-1, keepdims=True)
    return (o - mu) * jax.lax.rsqrt(((o - mu) ** 2).mean(-1, keepdims=True) + eps)


def _rms(o, scale=None, eps=1e-6):
    o = o.astype(jnp.float32)
    o = o * jax.lax.rsqrt((o * o).mean(-1, keepdims=True) + eps)
    return o if scale is None else o * scale


class _HeadRecurrence(MixerModule):
    """What the multi-head recurrences share: the static settings, and ``__call__`` as
    project -> one-head recurrence over batch and heads (both ways when not causal) -> output.

    A kind defines ``_inputs(x, kv_mask) -> (per_head, shared, ctx)`` (``[B, L, H, ...]``
    arrays, ``[B, L, ...]`` arrays every head reads, anything ``_out`` needs), ``_core(*arrays,
    kv_mask)`` (one head of one sequence, a function of :mod:`xformers_jax.mixers`) and
    ``_out(x, o, ctx)``. A kind whose record claims segment ids (``Kind.segments``) takes
    ``_core(*arrays, kv_mask, segment_ids=int[L])`` for packed rows."""

    num_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)
    implementation: str = eqx.field(static=True)

    def _settings(self, num_heads, causal, chunk_size, implementation):
        self.num_heads, self.causal = num_heads, causal
        self.chunk_size, self.implementation = chunk_size, implementation

    def _form(self):
        return dict(implementation=self.implementation, chunk_size=self.chunk_size)

    def __call__(self, x, *, kv_mask=None, positions=None, key=None, segment_ids=None):
        # Packed rows (segment_ids [B, L]) reach only the kinds whose records claim them
        # (Kind.segments; the block checks), whose _inputs and _core take segment_ids.
        x = check_mask(type(self).__name__, x, kv_mask)
        if segment_ids is None:
            per_head, shared, ctx = self._inputs(x, kv_mask)
        else:
            per_head, shared, ctx = self._inputs(x, kv_mask, segment_ids=segment_ids)
        o = _per_head(self._core, self.causal, per_head, shared, kv_mask=kv_mask,
                      segment_ids=segment_ids)
        return zero_padded(self._out(x, o, ctx), kv_mask)


class _QKVRecurrence(_HeadRecurrence):
    """A recurrence over per-head queries, keys and values (RetNet, GLA, Gated DeltaNet):
    ``wq, wk: [dim, H dk]``, ``wv: [dim, dim]``, a per-kind output gate ``_gate`` and
    per-head normalisation ``_norm``, then ``wo``; a state ``[B, H, dk, dv]`` decoded by the
    kind's ``_step(state, q_t, k_t, v_t, *gates_t)``. A kind's ``_project(x, segment_ids)``
    returns ``(q, k, v, *gates)`` as ``[B, L, H, ...]`` arrays.

    ``short_conv = W > 0`` (the kinds that take it): the projected q, k and v pass through a
    causal depthwise convolution of ``W`` taps without bias before the kind's own activations,
    as Gated DeltaNet, Kimi Delta Attention, DeltaProduct and xLSTM's mLSTM block build them
    (``ShortConvolution``; W = 4 in those papers). It lets the recurrence write a key formed
    from earlier tokens beside the current value (binding a key to the token after it, as
    associative recall needs; Arora et al. 2023, "Zoology", section 4). Decoding keeps the last
    ``W - 1`` steps' q, k and v projections beside the state (a step projects only its own
    token), so a step equals the forward pass; packed rows restart it at every document."""

    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    conv_w: jax.Array | None = None

    def _init_qkv(self, ks, dim, dk):
        self.wq, self.wk, self.wv = dense(ks[0], dim, dk), dense(ks[1], dim, dk), dense(
            ks[2], dim, dim)

    def _init_conv(self, key, short_conv):
        """The short convolution's taps ``[W, channels of q, k and v]`` (none for ``W = 0``);
        after the projections are made."""
        if not isinstance(short_conv, int) or isinstance(short_conv, bool) or short_conv < 0:
            raise ValueError(f"{type(self).__name__}: short_conv must be an int >= 0 (taps of "
                             f"the short convolution; 0 for none), got {short_conv!r}")
        width = sum(w.shape[1] for w in (self.wq, self.wk, self.wv))
        self.conv_w = _conv_init(key, short_conv, width) if short_conv else None

    def _short_conv(self, arrays, segment_ids=None):
        """``arrays`` (``[B, L, C_i]`` projections) through the short convolution, each
        channel its own taps; unchanged without one."""
        if self.conv_w is None:
            return arrays
        sizes = [a.shape[-1] for a in arrays]
        y = _causal_conv(jnp.concatenate(arrays, -1), self.conv_w, None, segment_ids)
        cuts = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
        return tuple(jnp.split(y, cuts, axis=-1))

    def _conv_qkv(self, x, segment_ids=None, qkv=None):
        """The projected q, k and v ``[B, L, C_i]`` after the short convolution (``qkv``:
        already computed, by a decoding step)."""
        if qkv is not None:
            return qkv
        dt = x.dtype
        return self._short_conv(tuple(x @ w.astype(dt) for w in (self.wq, self.wk, self.wv)),
                                segment_ids)

    def _qkv(self, x, segment_ids=None, qkv=None):
        return tuple(_heads(a, self.num_heads) for a in self._conv_qkv(x, segment_ids, qkv))

    def _inputs(self, x, kv_mask, segment_ids=None):
        # x is zero at padded positions (check_mask), so no padded input reaches a real
        # position through the short convolution's taps.
        return self._project(x, segment_ids), (), None

    def _out(self, x, o, ctx=None):
        o = self._norm(o).reshape(x.shape).astype(x.dtype)
        gate = x @ self._gate_weight().astype(x.dtype)
        return (jax.nn.silu(gate) * o) @ self.wo.astype(x.dtype)

    def _init_state(self, batch):
        h = self.num_heads
        dk, dv = self.wq.shape[1] // h, self.wv.shape[1] // h
        return jnp.zeros((batch, h, dk, dv), jnp.float32)

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        state = self._init_state(batch)
        if self.conv_w is None:
            return recurrent_cache(state)
        window = jnp.zeros((batch, self.conv_w.shape[0] - 1, self.conv_w.shape[1]), dtype)
        return recurrent_cache((state, window))

    def decode(self, x, cache):
        qkv, state = None, cache.state
        if self.conv_w is not None:
            # The last W - 1 steps' q, k and v projections (before the convolution) and this
            # step's: the convolution's output at this step is the taps over that window.
            state, window = state
            dt = x.dtype
            sizes = [w.shape[1] for w in (self.wq, self.wk, self.wv)]
            new = jnp.concatenate([x @ w.astype(dt) for w in (self.wq, self.wk, self.wv)], -1)
            pre = jnp.concatenate([window.astype(dt), new], axis=1)
            y = jnp.einsum("bwc,wc->bc", pre, self.conv_w.astype(dt))[:, None]
            qkv = tuple(jnp.split(y, [sizes[0], sizes[0] + sizes[1]], axis=-1))
        arrays = (a[:, -1].astype(jnp.float32) for a in self._project(x, qkv=qkv))
        o, s = jax.vmap(jax.vmap(self._step))(state, *arrays)
        if self.conv_w is not None:
            s = (s, pre[:, 1:].astype(window.dtype))
        return self._out(x, o[:, None]), type(cache)(s, cache.index + 1)


@implements("retnet")
class RetNet(_QKVRecurrence):
    """Multi-scale retention (Sun et al. 2023): ``gamma_h = 1 - 2^(-5 - h)`` per head,
    GroupNorm per head, swish output gate. Hyperparameters: ``chunk_size``,
    ``implementation`` (``"chunked"``, ``"parallel"``, ``"recurrent"``)."""

    wg: jax.Array
    wo: jax.Array

    def __init__(self, dim, num_heads, *, causal, max_len, key, chunk_size=64,
                 implementation="chunked", short_conv=0):
        if dim % num_heads:
            raise ValueError(f"RetNet: dim={dim} is not divisible by num_heads={num_heads}")
        ks = jax.random.split(key, 5)
        self._init_qkv(ks, dim, dim)
        self._init_conv(jax.random.fold_in(key, 2), short_conv)
        self.wg, self.wo = dense(ks[3], dim, dim), dense(ks[4], dim, dim)
        self._settings(num_heads, causal, chunk_size, implementation)

    @property
    def log_gamma(self):
        return jnp.log1p(-2.0 ** (-5.0 - jnp.arange(self.num_heads, dtype=jnp.float32)))

    def _project(self, x, segment_ids=None, qkv=None):
        q, k, v = self._qkv(x, segment_ids, qkv)
        lg = jnp.broadcast_to(self.log_gamma, q.shape[:3])
        return q, k / math.sqrt(q.shape[-1]), v, lg

    def _core(self, q, k, v, lg, m, segment_ids=None):
        return M.retention(q, k, v, lg, kv_mask=m, segment_ids=segment_ids, **self._form())

    _step = staticmethod(causal_step)
    _norm = staticmethod(_head_norm)

    def _gate_weight(self):
        return self.wg


@implements("gla")
class GLA(_QKVRecurrence):
    """Gated linear attention (Yang et al. 2024): keys of width ``head_dim / 2``, low-rank
    data-dependent gates ``alpha = sigmoid(x W1 W2 + b)^(1/16)``, a swish output gate and
    per-head RMS normalisation. Hyperparameters: ``chunk_size`` (default 16,
    ``mixers.GLA_CHUNK``), ``implementation``."""

    wa1: jax.Array
    wa2: jax.Array
    ba: jax.Array
    wr: jax.Array
    wo: jax.Array

    TEMPERATURE = 16.0
    GATE_RANK = 16

    def __init__(self, dim, num_heads, *, causal, max_len, key, chunk_size=GLA_CHUNK,
                 implementation="chunked", short_conv=0):
        if dim % (2 * num_heads):
            raise ValueError(f"GLA: dim={dim} must be divisible by 2 * num_heads={num_heads}")
        ks = jax.random.split(key, 7)
        dk = dim // 2
        self._init_qkv(ks, dim, dk)
        self._init_conv(jax.random.fold_in(key, 2), short_conv)
        self.wr, self.wo = dense(ks[3], dim, dim), dense(ks[4], dim, dim)
        self.wa1 = dense(ks[5], dim, self.GATE_RANK)
        self.wa2 = dense(ks[6], self.GATE_RANK, dk)
        self.ba = jnp.zeros((dk,))
        self._settings(num_heads, causal, chunk_size, implementation)

    def _project(self, x, segment_ids=None, qkv=None):
        dt = x.dtype
        q, k, v = self._qkv(x, segment_ids, qkv)
        logits = (x @ self.wa1.astype(dt)) @ self.wa2.astype(dt) + self.ba.astype(dt)
        ld = jax.nn.log_sigmoid(logits.astype(jnp.float32)) / self.TEMPERATURE
        return q, k / math.sqrt(k.shape[-1]), v, _heads(ld, self.num_heads)

    def _core(self, q, k, v, ld, m, segment_ids=None):
        return M.gla(q, k, v, ld, kv_mask=m, segment_ids=segment_ids, **self._form())

    _step = staticmethod(causal_step)
    _norm = staticmethod(_rms)

    def _gate_weight(self):
        return self.wr


@implements("gated_deltanet")
class GatedDeltaNet(_QKVRecurrence):
    """Gated DeltaNet (Yang, Kautz and Hatamizadeh 2025): SiLU then L2-normalised q, k per
    head, ``beta = sigmoid(x W_beta)``, Mamba-2's decay ``log a = -exp(a_log) softplus(x W_a +
    dt_bias)``, the gated delta rule, per-head RMS norm, swish output gate. Hyperparameters:
    ``chunk_size``, ``implementation`` (``"chunked"``, ``"recurrent"``, ``"parallel"``),
    ``dt_min``, ``dt_max``."""

    w_beta: jax.Array
    w_a: jax.Array
    a_log: jax.Array
    dt_bias: jax.Array
    wg: jax.Array
    wo: jax.Array

    def __init__(self, dim, num_heads, *, causal, max_len, key, chunk_size=64,
                 implementation="chunked", dt_min=1e-3, dt_max=1e-1, short_conv=0):
        if dim % num_heads:
            raise ValueError(f"GatedDeltaNet: dim={dim} is not divisible by "
                             f"num_heads={num_heads}")
        ks = jax.random.split(key, 8)
        self._init_qkv(ks, dim, dim)
        self._init_conv(jax.random.fold_in(key, 2), short_conv)
        self.wg, self.wo = dense(ks[3], dim, dim), dense(ks[4], dim, dim)
        self.w_beta = dense(ks[5], dim, num_heads)
        self.w_a = dense(ks[6], dim, num_heads)
        self.a_log = jnp.log(jax.random.uniform(ks[7], (num_heads,), minval=1, maxval=16))
        self.dt_bias = _dt_bias(jax.random.fold_in(key, 1), (num_heads,), dt_min, dt_max)
        self._settings(num_heads, causal, chunk_size, implementation)

    def _project(self, x, segment_ids=None, qkv=None):
        dt = x.dtype
        l2 = lambda a: a * jax.lax.rsqrt(jnp.sum(a * a, -1, keepdims=True) + 1e-6)  # noqa: E731
        q, k, v = self._qkv(x, segment_ids, qkv)
        q, k = (l2(jax.nn.silu(a).astype(jnp.float32)) for a in (q, k))
        beta = jax.nn.sigmoid((x @ self.w_beta.astype(dt)).astype(jnp.float32))
        ld = -jnp.exp(self.a_log) * jax.nn.softplus(
            (x @ self.w_a.astype(dt)).astype(jnp.float32) + self.dt_bias)
        return q, k, v, beta, ld

    def _core(self, q, k, v, beta, ld, m, segment_ids=None):
        return M.gated_delta(q, k, v, beta, ld, kv_mask=m, segment_ids=segment_ids,
                             **self._form())

    _step = staticmethod(gated_delta_step)
    _norm = staticmethod(_rms)

    def _gate_weight(self):
        return self.wg


def _conv_init(key, width, channels):
    return jax.random.uniform(key, (width, channels), minval=-1, maxval=1) / math.sqrt(width)


def _dt_bias(key, shape, dt_min, dt_max):
    # softplus^-1 of log-uniform step sizes (Gu and Dao 2023, the dt initialisation).
    dt = jnp.exp(log_uniform(key, shape, dt_min, dt_max))
    return dt + jnp.log(-jnp.expm1(-dt))


@implements("mamba2")
class Mamba2(_HeadRecurrence):
    """Mamba-2 (Dao and Gu 2024): in-projection to ``z, x, B, C, dt``, a short causal
    convolution on ``x, B, C``, SSD with a scalar decay ``exp(dt a_h)`` per head, ``D`` skip,
    gated RMS norm ``norm(y * silu(z))``, out-projection. Hyperparameters: ``state_size``
    (N), ``expand``, ``conv_width``, ``dt_min``, ``dt_max``, ``chunk_size``,
    ``implementation``."""

    w_in: jax.Array
    conv_w: jax.Array
    conv_b: jax.Array
    a_log: jax.Array
    dt_bias: jax.Array
    skip: jax.Array
    norm_scale: jax.Array
    w_out: jax.Array
    state_size: int = eqx.field(static=True)

    def __init__(self, dim, num_heads, *, causal, max_len, key, state_size=64, expand=2,
                 conv_width=4, dt_min=1e-3, dt_max=1e-1, chunk_size=64,
                 implementation="chunked"):
        inner = expand * dim
        if inner % num_heads:
            raise ValueError(f"Mamba2: expand * dim = {inner} is not divisible by "
                             f"num_heads={num_heads}")
        ks = jax.random.split(key, 5)
        n = state_size
        self.w_in = dense(ks[0], dim, 2 * inner + 2 * n + num_heads)
        self.conv_w = _conv_init(ks[1], conv_width, inner + 2 * n)
        self.conv_b = jnp.zeros((inner + 2 * n,))
        self.a_log = jnp.log(jax.random.uniform(ks[2], (num_heads,), minval=1, maxval=16))
        self.dt_bias = _dt_bias(ks[3], (num_heads,), dt_min, dt_max)
        self.skip = jnp.ones((num_heads,))
        self.norm_scale = jnp.ones((inner,))
        self.w_out = dense(ks[4], inner, dim)
        self.state_size = n
        self._settings(num_heads, causal, chunk_size, implementation)

    def _split(self, x):
        inner = self.norm_scale.shape[0]
        zxbcdt = x @ self.w_in.astype(x.dtype)
        return (zxbcdt[..., :inner], zxbcdt[..., inner: 2 * inner + 2 * self.state_size],
                zxbcdt[..., 2 * inner + 2 * self.state_size:])

    def _heads_of(self, xbc, dt_raw):
        inner, n = self.norm_scale.shape[0], self.state_size
        xbc = jax.nn.silu(xbc)
        xs, b, c = xbc[..., :inner], xbc[..., inner: inner + n], xbc[..., inner + n:]
        dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + self.dt_bias)
        return _heads(xs, self.num_heads), b, c, dt

    def _out(self, x, y, ctx):
        xs, z = ctx
        y = y + self.skip[:, None] * xs.astype(jnp.float32)
        y = y.reshape(*x.shape[:-1], -1) * jax.nn.silu(z.astype(jnp.float32))
        return (_rms(y, self.norm_scale)).astype(x.dtype) @ self.w_out.astype(x.dtype)

    def _inputs(self, x, kv_mask, segment_ids=None):
        z, xbc, dt_raw = self._split(x)
        if kv_mask is not None:  # padded inputs reach no real position through the conv
            xbc = jnp.where(kv_mask[..., None], xbc, 0)
        # Packed rows: no tap of the short convolution reads another document.
        xs, b, c, dt = self._heads_of(
            _causal_conv(xbc, self.conv_w, self.conv_b, segment_ids), dt_raw)
        a = jnp.broadcast_to(-jnp.exp(self.a_log), dt.shape)
        return (xs, dt, a), (b, c), (xs, z)

    def _core(self, xs, dt, a, b, c, m, segment_ids=None):
        # a: the head's decay rate repeated along the sequence ([L], so flipping keeps it).
        return M.ssd(xs, dt, a[0], b, c, kv_mask=m, segment_ids=segment_ids, **self._form())

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        inner = self.norm_scale.shape[0]
        p = inner // self.num_heads
        return recurrent_cache((
            jnp.zeros((batch, self.num_heads, self.state_size, p), jnp.float32),
            jnp.zeros((batch, self.conv_w.shape[0] - 1, self.conv_w.shape[1]), jnp.float32)))

    def decode(self, x, cache):
        ssm, buf = cache.state
        z, xbc, dt_raw = self._split(x)
        xbc_t, buf = _conv_step(buf, xbc[:, 0], self.conv_w, self.conv_b)
        xs, b, c, dt = self._heads_of(xbc_t[:, None], dt_raw)
        xs, b, c, dt = xs[:, 0].astype(jnp.float32), b[:, 0], c[:, 0], dt[:, 0]
        a = -jnp.exp(self.a_log)

        def head(s, x_h, dt_h, a_h, b_, c_):
            return causal_step(s, c_, b_ * dt_h, x_h, dt_h * a_h)

        step = jax.vmap(jax.vmap(head, in_axes=(0, 0, 0, 0, None, None)),
                        in_axes=(0, 0, 0, None, 0, 0))
        y, ssm = step(ssm, xs, dt, a, b.astype(jnp.float32), c.astype(jnp.float32))
        return self._out(x, y[:, None], (xs[:, None], z)), type(cache)((ssm, buf), cache.index + 1)


@implements("mamba")
class Mamba(MixerModule):
    """Mamba (Gu and Dao 2023): in-projection to ``x, z``, short causal convolution, SiLU,
    input-dependent ``dt`` (rank ``ceil(dim / 16)``), ``B``, ``C``, the selective scan with
    ``A = -exp(a_log)`` (S4D-real init ``A_n = -(n + 1)``), ``D`` skip, ``y * silu(z)``,
    out-projection. Hyperparameters: ``state_size``, ``expand``, ``conv_width``, ``dt_min``,
    ``dt_max``, ``implementation`` (``"auto"``: the loop on a CPU, the associative scan
    elsewhere; or ``"loop"``, ``"associative"``, ``"sequential"``: ``mixers.selective_scan``)."""

    w_in: jax.Array
    conv_w: jax.Array
    conv_b: jax.Array
    w_x: jax.Array
    w_dt: jax.Array
    dt_bias: jax.Array
    a_log: jax.Array
    skip: jax.Array
    w_out: jax.Array
    causal: bool = eqx.field(static=True)
    implementation: str = eqx.field(static=True)

    def __init__(self, dim, num_heads, *, causal, max_len, key, state_size=16, expand=2,
                 conv_width=4, dt_min=1e-3, dt_max=1e-1, implementation="auto"):
        inner, rank = expand * dim, -(-dim // 16)
        ks = jax.random.split(key, 6)
        self.w_in = dense(ks[0], dim, 2 * inner)
        self.conv_w = _conv_init(ks[1], conv_width, inner)
        self.conv_b = jnp.zeros((inner,))
        self.w_x = dense(ks[2], inner, rank + 2 * state_size)
        self.w_dt = dense(ks[3], rank, inner) * rank ** -0.5
        self.dt_bias = _dt_bias(ks[4], (inner,), dt_min, dt_max)
        self.a_log = jnp.log(jnp.broadcast_to(jnp.arange(1, state_size + 1, dtype=jnp.float32),
                                              (inner, state_size)))
        self.skip = jnp.ones((inner,))
        self.w_out = dense(ks[5], inner, dim)
        self.causal, self.implementation = causal, implementation

    def _ssm_inputs(self, xc):
        rank = self.w_dt.shape[0]
        n = self.a_log.shape[1]
        proj = xc @ self.w_x.astype(xc.dtype)
        dt = jax.nn.softplus((proj[..., :rank] @ self.w_dt.astype(xc.dtype)).astype(
            jnp.float32) + self.dt_bias)
        return dt, proj[..., rank: rank + n], proj[..., rank + n:]

    def _out(self, x, y, xc, z):
        y = (y + self.skip * xc.astype(jnp.float32)) * jax.nn.silu(z.astype(jnp.float32))
        return y.astype(x.dtype) @ self.w_out.astype(x.dtype)

    def __call__(self, x, *, kv_mask=None, positions=None, key=None, segment_ids=None):
        x = check_mask("Mamba", x, kv_mask)
        inner = self.skip.shape[0]
        xz = x @ self.w_in.astype(x.dtype)
        xs, z = xz[..., :inner], xz[..., inner:]
        if kv_mask is not None:
            xs = jnp.where(kv_mask[..., None], xs, 0)
        # Packed rows: neither the short convolution nor the scan crosses a document.
        xc = jax.nn.silu(_causal_conv(xs, self.conv_w, self.conv_b, segment_ids))
        dt, b, c = self._ssm_inputs(xc)
        a = -jnp.exp(self.a_log)

        def one(xc, dt, b, c, m, seg):
            run = lambda rev: M.selective_scan(  # noqa: E731
                xc, dt, a, b, c, kv_mask=m, implementation=self.implementation, reverse=rev,
                segment_ids=seg)
            return run(False) if self.causal else run(False) + run(True)

        y = jax.vmap(one, in_axes=(0, 0, 0, 0, None if kv_mask is None else 0,
                                   None if segment_ids is None else 0))(
            xc, dt, b, c, kv_mask, segment_ids)
        return zero_padded(self._out(x, y, xc, z), kv_mask)

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        return recurrent_cache((jnp.zeros((batch, *self.a_log.shape), jnp.float32),
                                jnp.zeros((batch, self.conv_w.shape[0] - 1, self.conv_w.shape[1]),
                                          jnp.float32)))

    def decode(self, x, cache):
        h, buf = cache.state
        inner = self.skip.shape[0]
        xz = x[:, 0] @ self.w_in.astype(x.dtype)
        xs, z = xz[..., :inner], xz[..., inner:]
        xc_t, buf = _conv_step(buf, xs, self.conv_w, self.conv_b)
        xc = jax.nn.silu(xc_t)
        dt, b, c = self._ssm_inputs(xc)
        a = -jnp.exp(self.a_log)
        y, h = jax.vmap(selective_step, in_axes=(0, 0, 0, None, 0, 0))(
            h, xc.astype(jnp.float32), dt, a, b.astype(jnp.float32), c.astype(jnp.float32))
        return self._out(x, y[:, None], xc[:, None], z[:, None]), type(cache)((h, buf),
                                                                            cache.index + 1)
