"""Position representations (Lin et al., 2022, "A Survey of Transformers", section 5.1).

Three abstract kinds of :class:`PositionScheme`, by where a scheme enters the model, which
decides what it composes with; the concrete schemes are final subclasses of one of them:

* :class:`InputScheme` (added to the token embeddings): :class:`SinusoidalPositions`,
  :class:`LearnedPositions`, :class:`LearnedSinusoidalPositions`, :class:`ConvPositions` (CPE),
  :class:`NoPositions`. They compose with every attention kind.
* :class:`QKScheme` (transforms queries and keys): :class:`RotaryPositions` (RoPE). It composes
  with every kind; scores depend only on ``i - j`` for softmax kinds (for kernel kinds the
  rotation is applied before the feature map, which keeps the module well defined but not
  exactly relative).
* :class:`BiasScheme` (an additive score bias): :class:`ALiBi`, :class:`T5Bias`,
  :class:`ShawRelative`, :class:`TransformerXLRelative`, :class:`DeBERTaRelative`,
  :class:`TUPE`. Biases are pytree callables ``bias(q_index, k_index)`` evaluated per tile by
  exact kernels, so no ``L x L`` array is built. They compose only with kinds whose record
  (``xformers_jax.kinds.Kind``) says ``bias=True`` (softmax-style kinds);
  :class:`~xformers_jax.nn.MultiHeadAttention` rejects the others.

Biases read absolute positions through ``q_pos``/``k_pos`` arrays, so a decoding step (one query
at position t against a cache of keys at their own positions) uses the same code.
"""

from __future__ import annotations

import abc
import math
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import axes as X
from ..kernels import STATS_DTYPE


def sinusoid(positions, dim: int, base: float = 10000.0):
    """``PE(t)_{2i} = sin(t w_i)``, ``PE(t)_{2i+1} = cos(t w_i)``, ``w_i = base^(-2i/dim)``
    (Vaswani et al., 2017). positions: int ``[...]`` -> float32 ``[..., dim]``."""
    return _interleave(positions.astype(jnp.float32)[..., None] * _freqs(dim, base), dim)


def _freqs(dim: int, base: float = 10000.0) -> np.ndarray:
    """The sinusoid's ``ceil(dim / 2)`` frequencies ``w_i = base^(-2i/dim)``."""
    return base ** (-np.arange(0, dim, 2, dtype=np.float32) / dim)


def _interleave(angles, dim):
    pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return pe.reshape(*angles.shape[:-1], -1)[..., :dim]


def document_positions(segment_ids):
    """Positions that restart at every document of packed rows: ``segment_ids int[B, L]`` (the
    document of each token; a new document starts wherever the id changes) -> ``int32[B, L]``,
    the offset of each token from its document's first token, so every position scheme sees
    a packed document as it would see it alone. Padding (any id, 0 by convention) counts as
    one more run."""
    if segment_ids.ndim != 2:
        raise ValueError(f"document_positions: segment_ids must be int[B, L], got shape "
                         f"{segment_ids.shape}")
    idx = jnp.broadcast_to(jnp.arange(segment_ids.shape[1], dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return idx - first


class PositionScheme(eqx.Module):
    """Abstract base of every position scheme: an :class:`InputScheme`, a :class:`QKScheme` or
    a :class:`BiasScheme` (see the module docstring)."""


# --- input schemes ---------------------------------------------------------------------------


class InputScheme(PositionScheme):
    """Abstract: positions added to the token embeddings, before any attention."""

    @abc.abstractmethod
    def embed(self, x, positions, *, mask=None, causal=False):
        """x: ``[B, L, D]``; positions: int ``[B, L]``; mask: ``bool[B, L]`` (real tokens);
        causal: the model is causal (no position may read a later one). Returns ``[B, L, D]``."""
        raise NotImplementedError


@final
class NoPositions(InputScheme):
    """No explicit positions (causal decoders can infer order; Haviv et al., 2022)."""

    def embed(self, x, positions, *, mask=None, causal=False):
        return x


@final
class SinusoidalPositions(InputScheme):
    """Fixed sinusoidal encodings added to the inputs (Vaswani et al., 2017)."""

    def embed(self, x, positions, *, mask=None, causal=False):
        return x + sinusoid(positions, x.shape[-1]).astype(x.dtype)


@final
class LearnedPositions(InputScheme):
    """A learned table of ``max_len`` absolute embeddings (Gehring et al., 2017; Devlin et al.,
    2019); not inductive."""

    # A position table, not a weight: not decayed.
    table: jax.Array = X.param(None, X.EMBED, decay=False)

    def __init__(self, max_len: int, dim: int, *, key):
        self.table = 0.02 * jax.random.normal(key, (max_len, dim))

    def embed(self, x, positions, *, mask=None, causal=False):
        n = self.table.shape[0]
        positions = eqx.error_if(positions, jnp.max(positions) >= n,
                                 f"LearnedPositions: a position is >= max_len={n}")
        return x + self.table[positions].astype(x.dtype)


@final
class LearnedSinusoidalPositions(InputScheme):
    """Sinusoids whose frequencies are learned (Wang et al., 2021): inductive."""

    log_freqs: jax.Array

    def __init__(self, dim: int, base: float = 10000.0):
        self.log_freqs = jnp.asarray(-np.arange(0, dim, 2) / dim * math.log(base), jnp.float32)

    def embed(self, x, positions, *, mask=None, causal=False):
        angles = positions.astype(jnp.float32)[..., None] * jnp.exp(self.log_freqs)
        return x + _interleave(angles, x.shape[-1]).astype(x.dtype)


@final
class ConvPositions(InputScheme):
    """Conditional position encoding (CPE; Chu et al., 2021): ``x + depthwise_conv(x)`` with zero
    padding; left padding only when causal, so no position sees a later one. Padded tokens are
    zeroed first so they do not leak into real ones. ``x: [B, L, D]``."""

    kernel: jax.Array

    def __init__(self, dim: int, kernel_size: int = 3, *, key):
        self.kernel = jax.random.normal(key, (kernel_size, dim)) / math.sqrt(kernel_size)

    def embed(self, x, positions, *, mask=None, causal=False):
        if mask is not None:
            x = jnp.where(mask[..., None], x, 0)
        w = self.kernel.shape[0]
        left = w - 1 if causal else (w - 1) // 2
        xp = jnp.pad(x, ((0, 0), (left, w - 1 - left), (0, 0)))
        conv = sum(xp[:, i : i + x.shape[1]] * self.kernel[i].astype(x.dtype) for i in range(w))
        return x + conv


# --- q/k schemes -----------------------------------------------------------------------------


class QKScheme(PositionScheme):
    """Abstract: a position-dependent transform of the queries and the keys, after projection."""

    @abc.abstractmethod
    def rotate(self, x, positions):
        """x: ``[B, L, H, D]`` (queries or keys); positions: int ``[B, L]``. Returns x's shape."""
        raise NotImplementedError


@final
class RotaryPositions(QKScheme):
    """RoPE (Su et al., 2021, "RoFormer"): rotates each pair of q/k features by
    ``t * theta_j``, so softmax scores depend on ``i - j`` only."""

    base: float = eqx.field(static=True, default=10000.0)

    def rotate(self, x, positions):
        """x: ``[B, L, H, D]`` (D even); positions: int ``[B, L]``."""
        d = x.shape[-1]
        if d % 2:
            raise ValueError(f"RotaryPositions: head dim must be even but got x{x.shape}")
        theta = self.base ** (-np.arange(0, d, 2, dtype=np.float32) / d)
        ang = positions.astype(jnp.float32)[:, :, None, None] * theta
        cos, sin = jnp.cos(ang), jnp.sin(ang)
        x1, x2 = x[..., 0::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
        out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
        return out.reshape(x.shape).astype(x.dtype)


# --- bias schemes ----------------------------------------------------------------------------


def _take(a, idx):
    # Exact kernels pad tiles past the sequence end; clipped reads there are masked anyway.
    return jnp.take(a, idx, axis=0, mode="clip")


class _Bias(eqx.Module):
    """A one-head score bias: a pytree callable of (q index ``[bq, 1]``, k index ``[1, bk]``)
    -> float32 scores ``[bq, bk]``, as exact kernels call it per tile."""

    q_pos: jax.Array
    k_pos: jax.Array
    arrays: tuple
    # The scheme with its arrays removed: hashable, so kernels can cache on it.
    scheme: "BiasScheme" = eqx.field(static=True)

    def __call__(self, i, j):
        return self.scheme.score(_take(self.q_pos, i), _take(self.k_pos, j), i, j, *self.arrays)


class BiasScheme(PositionScheme):
    """Abstract: an additive score bias built from positions (and, for some schemes, from q
    and k). Subclasses give the per-head arrays, the per-sequence arrays and the tile score."""

    def bias(self, q, k, q_pos, k_pos, scale):
        """q: ``[B, Lq, H, Dk]``, k: ``[B, Lk, Hkv, Dk]`` with ``H`` a multiple of ``Hkv`` (each
        kv head serves its group of ``H / Hkv`` query heads, without copies), positions int
        ``[B, L]``. Returns a bias pytree with leaves ``[B, H, ...]``."""
        b, h, hkv = q.shape[0], q.shape[2], k.shape[2]
        if h % hkv:
            raise ValueError(f"{type(self).__name__}.bias: {h} query heads are not a multiple "
                             f"of {hkv} key/value heads (q {q.shape}, k {k.shape})")
        groups = h // hkv
        per_head = jax.tree_util.tree_map(lambda a: a.reshape(hkv, groups, *a.shape[1:]),
                                          self.per_head_arrays())
        q = q.reshape(*q.shape[:2], hkv, groups, q.shape[-1])
        stripped = eqx.filter(self, eqx.is_array, inverse=True)

        def one(q1, k1, qp, kp, head):
            arrays = self.arrays(q1, k1, qp, kp, head, scale)
            return _Bias(qp.astype(jnp.int32), kp.astype(jnp.int32), arrays, stripped)

        f = jax.vmap(one, in_axes=(1, None, None, None, 0))  # query heads of one group
        f = jax.vmap(f, in_axes=(1, 1, None, None, 0))  # kv heads
        f = jax.vmap(f, in_axes=(0, 0, 0, 0, None))  # batch
        out = f(q, k, q_pos, k_pos, per_head)
        return jax.tree_util.tree_map(lambda a: a.reshape(b, h, *a.shape[3:]), out)

    @abc.abstractmethod
    def per_head_arrays(self):
        """Arrays with a leading head axis (or None), sliced per head by :meth:`bias`."""
        raise NotImplementedError

    @abc.abstractmethod
    def arrays(self, q, k, q_pos, k_pos, head, scale):
        """One head and sequence's arrays (q ``[Lq, Dk]``, k ``[Lk, Dk]``, positions int
        ``[L]``, ``head`` from :meth:`per_head_arrays`): a tuple passed to :meth:`score`."""
        raise NotImplementedError

    @abc.abstractmethod
    def score(self, qp, kp, i, j, *arrays):
        """float32 ``[bq, bk]`` scores of one tile: positions ``qp [bq, 1]``, ``kp [1, bk]``
        (int32) and indices ``i [bq, 1]``, ``j [1, bk]`` into the sequences."""
        raise NotImplementedError


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's geometric slopes ``2^(-8 h / H)`` (Press et al.)."""
    return 2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)


@final
class ALiBi(BiasScheme):
    """Attention with linear biases: ``-m_h |i - j|`` (Press et al., 2022). A relative bias in
    the spirit of T5 (Raffel et al., 2020)."""

    slopes: X.Buffer  # fixed, never trained

    def __init__(self, num_heads: int):
        self.slopes = X.Buffer(jnp.asarray(alibi_slopes(num_heads), jnp.float32))

    def per_head_arrays(self):
        return jax.lax.stop_gradient(self.slopes.value)

    def arrays(self, q, k, q_pos, k_pos, head, scale):
        return (head,)

    def score(self, qp, kp, i, j, slope):
        return -slope * jnp.abs(qp - kp).astype(jnp.float32)


def t5_bucket(relative, *, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5's relative-position buckets of ``relative = j - i`` (Raffel et al., 2020):
    exact buckets for small distances, logarithmic ones up to ``max_distance``, then clipped."""
    n, ret = num_buckets, 0
    if bidirectional:
        n //= 2
        ret = jnp.where(relative > 0, n, 0)
        dist = jnp.abs(relative)
    else:
        dist = jnp.maximum(-relative, 0)
    exact = n // 2
    safe = jnp.maximum(dist, 1).astype(jnp.float32)
    log_bucket = exact + (
        jnp.log(safe / exact) / math.log(max_distance / exact) * (n - exact)
    ).astype(jnp.int32)
    return ret + jnp.where(dist < exact, dist, jnp.minimum(log_bucket, n - 1))


@final
class T5Bias(BiasScheme):
    """A learned scalar per (head, relative-distance bucket) (Raffel et al., 2020, T5)."""

    table: jax.Array = X.param(None, None, decay=False)  # a position table: not decayed
    num_buckets: int = eqx.field(static=True)
    max_distance: int = eqx.field(static=True)
    bidirectional: bool = eqx.field(static=True)

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, *,
                 bidirectional: bool = True, key):
        self.table = 0.02 * jax.random.normal(key, (num_heads, num_buckets))
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bidirectional

    def per_head_arrays(self):
        return self.table

    def arrays(self, q, k, q_pos, k_pos, head, scale):
        return (head,)

    def score(self, qp, kp, i, j, table):
        b = t5_bucket(kp - qp, bidirectional=self.bidirectional, num_buckets=self.num_buckets,
                      max_distance=self.max_distance)
        return table[b].astype(jnp.float32)


def clipped_distance(qp, kp, max_offset: int):
    """``clip(i - j, -K, K) + K``: the index into ``2K + 1`` embeddings of Shaw et al. (2018)."""
    return jnp.clip(qp - kp, -max_offset, max_offset) + max_offset


@final
class ShawRelative(BiasScheme):
    """Shaw et al. (2018): ``k'_j = k_j + R_clip(i-j)``, as the score term
    ``scale * q_i . R_clip(i-j)``. Only ``q R^T`` (``[Lq, 2K+1]``) is built, never ``L x L``."""

    embeddings: jax.Array = X.param(None, None, decay=False)  # a position table
    max_offset: int = eqx.field(static=True)

    def __init__(self, head_dim: int, max_offset: int = 16, *, key):
        self.embeddings = 0.02 * jax.random.normal(key, (2 * max_offset + 1, head_dim))
        self.max_offset = max_offset

    def per_head_arrays(self):
        return None

    def arrays(self, q, k, q_pos, k_pos, head, scale):
        qr = jnp.einsum("qd,rd->qr", q, self.embeddings.astype(q.dtype),
                        preferred_element_type=STATS_DTYPE)
        return (qr * scale,)

    def score(self, qp, kp, i, j, qr):
        r = clipped_distance(qp, kp, self.max_offset)
        return jnp.take_along_axis(_take(qr, i[:, 0]), r, axis=1)


@final
class DeBERTaRelative(BiasScheme):
    """DeBERTa's disentangled attention (He et al., 2021): content-to-position
    ``q_i . (r_ij W^{K,R})`` plus position-to-content ``k_j . (r_ij W^{Q,R})`` with Shaw's
    clipped relative embeddings ``r_ij``; built from ``[L, 2K+1]`` tables."""

    embeddings: jax.Array = X.param(None, None, decay=False)  # a position table
    w_kr: jax.Array
    w_qr: jax.Array
    max_offset: int = eqx.field(static=True)

    def __init__(self, num_heads: int, head_dim: int, max_offset: int = 16, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embeddings = 0.02 * jax.random.normal(k1, (2 * max_offset + 1, head_dim))
        self.w_kr = jax.random.normal(k2, (num_heads, head_dim, head_dim)) / math.sqrt(head_dim)
        self.w_qr = jax.random.normal(k3, (num_heads, head_dim, head_dim)) / math.sqrt(head_dim)
        self.max_offset = max_offset

    def per_head_arrays(self):
        return (self.w_kr, self.w_qr)

    def arrays(self, q, k, q_pos, k_pos, head, scale):
        w_kr, w_qr = head
        rk, rq = self.embeddings @ w_kr, self.embeddings @ w_qr
        qr = jnp.einsum("qd,rd->qr", q.astype(jnp.float32), rk)
        kr = jnp.einsum("kd,rd->kr", k.astype(jnp.float32), rq)
        return (qr * scale, kr * scale)

    def score(self, qp, kp, i, j, qr, kr):
        r = clipped_distance(qp, kp, self.max_offset)
        c2p = jnp.take_along_axis(_take(qr, i[:, 0]), r, axis=1)
        p2c = jnp.take_along_axis(_take(kr, j[0]).T, r, axis=0)
        return c2p + p2c


@final
class TransformerXLRelative(BiasScheme):
    """Transformer-XL's relative terms (Dai et al., 2019): ``q_i . R_{i-j} W + u1 . k_j +
    u2 . R_{i-j} W`` with sinusoidal ``R`` (``R_d = sinusoid(d)``, :func:`sinusoid`).

    No table of distances is gathered: by ``sin(a - b) = sin a cos b - cos a sin b`` (and the
    same for cos), ``g . R_{i-j}`` with ``g = (q_i + u2) W^T`` is the dot product of ``g``
    rotated by position ``i``'s angles with the sinusoid ``[cos, sin]`` of position ``j``, so a
    tile's relative term is one ``[bq, Dk] x [Dk, bk]`` matmul (the paper's "relative shift"
    without the shift, and exact for any positions: packed, padded, memories at negative
    offsets). Angles are taken relative to each sequence's first query position, so their
    size (and float32 rounding) follows the distances, not the absolute positions.

    ``max_len`` bounds the distances the model was built for (configs size it to segment plus
    memory); the sinusoid itself is defined at every distance, so nothing is clipped unless
    ``clamp_len`` is given: then a distance ``i - j > clamp_len`` reads ``R_{clamp_len}`` (the
    authors' ``clamp_len``, which their evaluation with memories longer than training's uses:
    distances never seen in training read as the longest one that was). A clamped score is
    one value per query, ``g_i . R_{clamp_len}``, selected where the distance exceeds it."""

    w_r: jax.Array
    u1: jax.Array
    u2: jax.Array
    max_len: int = eqx.field(static=True)
    clamp_len: int | None = eqx.field(static=True)

    def __init__(self, num_heads: int, head_dim: int, max_len: int,
                 clamp_len: int | None = None, *, key):
        if clamp_len is not None and (isinstance(clamp_len, bool)
                                      or not isinstance(clamp_len, int) or clamp_len < 0):
            raise ValueError(f"TransformerXLRelative: clamp_len must be None or an integer "
                             f">= 0, got {clamp_len!r}")
        self.w_r = jax.random.normal(key, (num_heads, head_dim, head_dim)) / math.sqrt(head_dim)
        self.u1 = jnp.zeros((num_heads, head_dim))
        self.u2 = jnp.zeros((num_heads, head_dim))
        self.max_len = max_len
        self.clamp_len = clamp_len

    def per_head_arrays(self):
        return (self.w_r, self.u1, self.u2)

    def arrays(self, q, k, q_pos, k_pos, head, scale):
        w_r, u1, u2 = head
        dk = w_r.shape[0]
        # g_i . sinusoid(i - j): g's interleaved (sin, cos) pairs rotated by i's angles, read
        # against j's (cos, sin). An odd Dk has a last sine with no cosine: pad g with a zero.
        g = ((q.astype(jnp.float32) + u2) * scale) @ w_r.T
        g = jnp.pad(g, ((0, 0), (0, dk % 2))).reshape(g.shape[0], -1, 2)
        freqs = _freqs(dk)
        origin = q_pos[:1]
        a = (q_pos - origin).astype(jnp.float32)[:, None] * freqs
        b = (k_pos - origin).astype(jnp.float32)[:, None] * freqs
        gs, gc = g[..., 0], g[..., 1]
        qr = jnp.stack([gs * jnp.sin(a) + gc * jnp.cos(a),
                        gc * jnp.sin(a) - gs * jnp.cos(a)], -1).reshape(q.shape[0], -1)
        kr = jnp.stack([jnp.cos(b), jnp.sin(b)], -1).reshape(k.shape[0], -1)
        uk = (k.astype(jnp.float32) @ u1) * scale
        if self.clamp_len is None:
            return (qr, jax.lax.stop_gradient(kr), uk)
        c = self.clamp_len * freqs
        clamped = (gs * np.sin(c) + gc * np.cos(c)).sum(-1)  # g_i . R_{clamp_len}
        return (qr, jax.lax.stop_gradient(kr), uk, clamped)

    def score(self, qp, kp, i, j, qr, kr, uk, clamped=None):
        s = _take(qr, i[:, 0]) @ _take(kr, j[0]).T
        if clamped is not None:
            s = jnp.where(qp - kp > self.clamp_len, _take(clamped, i[:, 0])[:, None], s)
        return s + _take(uk, j[0])[None, :]


@final
class TUPE(BiasScheme):
    """TUPE (Ke et al., 2021): untied absolute position-to-position term
    ``(p_i W^{Q,P}) . (p_j W^{K,P})`` plus a bucketed relative scalar ``b_{j-i}``. The learned
    absolute embeddings ``p`` live here, not on the inputs."""

    table: jax.Array = X.param(None, None, decay=False)  # position tables: not decayed
    w_qp: jax.Array
    w_kp: jax.Array
    rel: jax.Array = X.param(None, None, decay=False)
    num_buckets: int = eqx.field(static=True)
    max_distance: int = eqx.field(static=True)

    def __init__(self, num_heads: int, head_dim: int, max_len: int, num_buckets: int = 32,
                 max_distance: int = 128, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.table = 0.02 * jax.random.normal(k1, (max_len, head_dim))
        self.w_qp = jax.random.normal(k2, (num_heads, head_dim, head_dim)) / math.sqrt(head_dim)
        self.w_kp = jax.random.normal(k3, (num_heads, head_dim, head_dim)) / math.sqrt(head_dim)
        self.rel = jnp.zeros((num_heads, num_buckets))
        self.num_buckets, self.max_distance = num_buckets, max_distance

    def per_head_arrays(self):
        return (self.w_qp, self.w_kp, self.rel)

    def arrays(self, q, k, q_pos, k_pos, head, scale):
        w_qp, w_kp, rel = head
        return ((self.table @ w_qp) * scale, self.table @ w_kp, rel)

    def score(self, qp, kp, i, j, pq, pk, rel):
        pos = _take(pq, qp[:, 0]) @ _take(pk, kp[0]).T
        b = t5_bucket(kp - qp, bidirectional=True, num_buckets=self.num_buckets,
                      max_distance=self.max_distance)
        return pos + rel[b]
