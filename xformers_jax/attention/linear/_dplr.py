"""The generalised delta rule: a diagonal-plus-rank-one state transition, in two agreeing forms.

One recurrence covers the delta-rule family with per-channel (vector) decays::

    S_t = diag(exp(ld_t)) S_{t-1} + a_t (b_t^T S_{t-1}) + k_t v_t^T        out_t = q_t^T S_t

with ``q, k, a, b: [L, M]``, ``v: [L, E]`` and per-channel log-decays ``ld: [L, M] <= 0``. The
state is read by ``b_t`` *before* the decay and the read is written back along ``a_t``:

- Kimi Delta Attention (Kimi Linear, 2025): ``S_t = (I - beta_t k_t k_t^T) diag(alpha_t)
  S_{t-1} + beta_t k_t v_t^T`` is ``a = -beta k``, ``b = alpha * k``, key ``beta k``;
- RWKV-7 (Peng et al. 2025, "RWKV-7 Goose with Expressive Dynamic State Evolution", Eq. 17 in
  the column convention): ``S_t = (diag(w_t) - (a_t * kappa_t) kappa_t^T) S_{t-1} + k_t v_t^T``
  is ``a = -(a_t * kappa_t)``, ``b = kappa_t``;
- a scalar decay and ``a = -beta k``, ``b = alpha k`` is the gated delta rule of
  :mod:`._delta` (whose chunked form is specialised to scalar decays).

Chunkwise form (the "DPLR" chunking of Yang et al. 2024's delta-rule algorithm extended to
per-channel decays): within a chunk, with within-chunk cumulative log-decays ``g_t`` (through
step t) and ``p_t = g_t - ld_t`` (before it), the reads ``u_t = b_t^T S_{t-1}`` satisfy the
unit lower-triangular system ``(I - P_ba) U = (b * exp(p)) S_0 + P_bk V`` with ``P_xy[t, j] =
sum_m x_tm y_jm exp(p_tm - g_jm)`` for ``j < t``; then ``out = (q * exp(g)) S_0 + Q_qa U + Q_qk
V`` with ``Q_xy[t, j] = sum_m x_tm y_jm exp(g_tm - g_jm)`` for ``j <= t``, and the chunk's end
state is ``exp(g_c) S_0 + (a * exp(g_c - g))^T U + (k * exp(g_c - g))^T V``. Every exponent
is a within-chunk decay difference ``<= 0``, so nothing overflows however strong the decay.
The systems are inverted by :func:`._delta.unit_lower_inverse` and the chunks run on the
chunked scan's :func:`._scan.chunk_groups`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from ._delta import unit_lower_inverse
from ._scan import GROUP_POSITIONS, chunk_groups


def dplr_step(s, q_t, k_t, v_t, a_t, b_t, ld_t):
    """One step ``S_t = diag(exp(ld_t)) S_{t-1} + a_t (b_t^T S_{t-1}) + k_t v_t^T``,
    ``out_t = q_t^T S_t``.

    Args:
      s: ``[M, E]`` state. q_t, k_t, a_t, b_t, ld_t: ``[M]``. v_t: ``[E]``.

    Returns:
      ``(out_t [E], S_t)``.
    """
    s = jnp.exp(ld_t)[:, None] * s + a_t[:, None] * (b_t @ s)[None, :] + k_t[:, None] * v_t[None]
    return q_t @ s, s


def dplr_recurrent(
    q: Float[Array, "seq m"],
    k: Float[Array, "seq m"],
    v: Float[Array, "seq e"],
    a: Float[Array, "seq m"] | None,
    b: Float[Array, "seq m"],
    ld: Float[Array, "seq m"],
) -> Float[Array, "seq e"]:
    """The generalised delta rule by a per-step scan (the reference form).

    Args:
      q, k, b: ``[L, M]``. a: ``[L, M]``, or None for ``a = -k``. v: ``[L, E]``.
      ld: ``[L, M]`` log-decays ``<= 0``.

    Returns:
      ``[L, E]``.
    """
    a = -k if a is None else a

    def step(s, x):
        return dplr_step(s, *x)[::-1]

    init = jnp.zeros((k.shape[1], v.shape[1]), jnp.result_type(k, v))
    return lax.scan(step, init, (q, k, v, a, b, ld))[1]


def _shift(x, d):
    """``x[..., t - d, :]`` along the positions axis (``-2``), zeros for ``t < d``; ``d < 0``
    shifts the other way."""
    c = x.shape[-2]
    pad = [(0, 0)] * (x.ndim - 2)
    if d >= 0:
        return jnp.pad(x, pad + [(d, 0), (0, 0)])[..., :c, :]
    return jnp.pad(x, pad + [(0, -d), (0, 0)])[..., -d:, :]


def _band(c, sub, d, dtype):
    """``[c, c]``: 1 at ``(t, t - d)`` where ``t - d`` is in ``t``'s sub-chunk of ``sub``."""
    t = jnp.arange(c)
    return ((t[:, None] - d == t[None, :]) & (t[:, None] % sub >= d)).astype(dtype)


def _across(xs, ys, gx, gy, sub):
    """The pairs of sub-chunks ``I > J`` of :func:`_scores`, packed (the ``(ns - 1) ns / 2``
    lower blocks only, ``ns = c / sub``): ``xs`` and ``ys`` gathered per pair with their
    factors through ``I``'s reference point (``xs`` scaled, ``[P, n, pairs, sub, M]``; ``ys``
    and its scale ``[n, pairs, sub, M]`` apart), and the one-hot
    ``[pairs, ns]`` maps from pairs to ``I`` and to ``J``."""
    _, n, c, m = xs.shape
    ns = c // sub
    rows, cols = np.tril_indices(ns, -1)
    gxb, gyb = gx.reshape(n, ns, sub, m), gy.reshape(n, ns, sub, m)
    ref = gxb[:, :, :1]  # each sub-chunk's reference point: its first gx
    xp = (xs.reshape(-1, n, ns, sub, m) * jnp.exp(gxb - ref))[:, :, rows]
    y_scale = jnp.exp(ref[:, rows] - gyb[:, cols])
    eye = np.eye(ns, dtype=np.float32)
    return (xp, ys.reshape(-1, n, ns, sub, m)[:, :, cols], y_scale,
            jnp.asarray(eye[rows], xs.dtype), jnp.asarray(eye[cols], xs.dtype))


def _offset_decay(gx, gy, d):
    """``exp(gx_t - gy_{t-d})``, ``[n, c, M]``; the minimum keeps exp off the positive
    exponents of the pairs :func:`_band` drops (the pairs it keeps are ``<= 0``)."""
    return jnp.exp(jnp.minimum(gx - _shift(gy, d), 0.0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _scores(xs, ys, gx, gy, sub):
    """``S[p, q, n, t, j] = sum_m xs[p, n, t, m] ys[q, n, j, m] exp(gx[n, t, m] - gy[n, j, m])``
    for ``j < t`` (zero elsewhere): the ``[c, c]`` score matrices of a chunk for every pair of
    ``xs: [P, n, c, M]`` and ``ys: [Q, n, c, M]`` sharing the cumulative log-decays
    ``gx, gy: [n, c, M]``.

    Needs ``gx_t <= gx_r <= gy_j`` whenever ``r`` is the first position of ``t``'s sub-chunk of
    ``sub`` positions and ``j < r``, and ``gx_t <= gy_j`` for ``j < t`` (true for ``gx = p``,
    ``gy = g`` of :func:`_dplr_chunks`). Within a sub-chunk the per-channel decays are applied
    pairwise, one offset ``t - j`` at a time (``sub - 1`` products over ``[c, M]``: exact for
    any decay); across sub-chunks a pair factorises through that reference point,
    ``exp(gx_t - gx_r) exp(gx_r - gy_j)``, both factors ``<= 1``, so the product is a matrix
    multiplication and no exponent is positive: the secondary chunking of Yang et al. (2024,
    GLA, Sec. 4.2), which keeps the ``[c, c, M]`` work to about ``s/c`` of it. Every sum over
    ``M`` is a ``dot_general``: XLA:CPU ran the multiply-and-reduce over the minor axis of
    ``[..., s, s, M]`` products several times slower.

    Its VJP (as GLA's in :mod:`._scan`) recomputes the decays and differentiates only the
    products: ``gx`` enters as a rescaling of ``xs`` by ``exp(gx)`` and ``gy`` of ``ys`` by
    ``exp(-gy)``, so ``dgx = sum_p xs dxs`` and ``dgy = -sum_q ys dys``; autodiff through the
    decays instead carried a cotangent for every decay factor.
    """
    c = xs.shape[2]
    xp, yp, y_scale, to_i, to_j = _across(xs, ys, gx, gy, sub)
    blocks = jnp.einsum("pnksm,qnktm->pqnkst", xp, yp * y_scale)
    out = jnp.einsum("pqnkst,ki,kj->pqnisjt", blocks, to_i, to_j).reshape(*blocks.shape[:3], c, c)
    for d in range(1, sub):
        inner = jnp.einsum("pncm,qncm->pqnc", xs, _shift(ys, d) * _offset_decay(gx, gy, d))
        out = out + inner[..., None] * _band(c, sub, d, out.dtype)
    return out


def _scores_fwd(xs, ys, gx, gy, sub):
    return _scores(xs, ys, gx, gy, sub), (xs, ys, gx, gy)


def _scores_bwd(sub, res, ds):
    xs, ys, gx, gy = res
    c = xs.shape[2]
    ns = c // sub
    xp, yp, y_scale, to_i, to_j = _across(xs, ys, gx, gy, sub)
    x_scale = jnp.exp(gx - jnp.repeat(gx[:, ::sub], sub, axis=1))
    d_blocks = jnp.einsum("pqnisjt,ki,kj->pqnkst", ds.reshape(*ds.shape[:3], ns, sub, ns, sub),
                          to_i, to_j)
    dxs = jnp.einsum("pqnkst,qnktm,ki->pnism", d_blocks, yp * y_scale, to_i)
    dxs = dxs.reshape(xs.shape) * x_scale
    dys = jnp.einsum("pqnkst,pnksm->qnktm", d_blocks, xp) * y_scale
    dys = jnp.einsum("qnktm,kj->qnjtm", dys, to_j).reshape(ys.shape)
    for d in range(1, sub):
        decay = _offset_decay(gx, gy, d)
        d_inner = jnp.sum(ds * _band(c, sub, d, ds.dtype), -1)  # [P, Q, n, c]
        dxs = dxs + jnp.einsum("pqnc,qncm->pncm", d_inner, _shift(ys, d) * decay)
        dys = dys + _shift(jnp.einsum("pqnc,pncm->qncm", d_inner, xs * decay), -d)
    return dxs, dys, jnp.sum(xs * dxs, 0), -jnp.sum(ys * dys, 0)


_scores.defvjp(_scores_fwd, _scores_bwd)


def _dplr_chunks(q, k, v, a, b, ld, s0, sub_chunk=4):
    """The chunkwise generalised delta rule over ``n`` chunks (``[n, c, ...]`` arrays) from the
    state ``s0``: (out ``[n, c, E]``, final state). See the module docstring. ``a = None`` is
    the delta rule's ``a = -k``, whose score matrices are those of ``k`` negated."""
    c = v.shape[1]
    sub = math.gcd(c, sub_chunk)
    g = jnp.cumsum(ld, axis=1)
    p = g - ld
    # The outputs' scores exp(g_t - g_j) are the reads' exp(p_t - g_j) scaled by exp(ld_t) <= 1
    # for j < t, and 1 for j = t: one set of decays serves both.
    qd = q * jnp.exp(ld)
    ys = jnp.stack([k] if a is None else [k, a])
    scores = _scores(jnp.stack([b, qd]), ys, p, g, sub)
    diagonal = jnp.eye(c, dtype=q.dtype) * jnp.sum(q * ys, -1)[..., None]  # [Q, n, c, c]
    p_bk, q_k = scores[0, 0], scores[1, 0] + diagonal[0]
    # U = x + w S_0 with [x, w] = (I - P_ba)^-1 [P_bk V, b * exp(p)]: one product for both.
    rhs = jnp.concatenate([p_bk @ v, b * jnp.exp(p)], -1)
    qg = q * jnp.exp(g)
    total = g[:, -1]
    kg = k * jnp.exp(total[:, None] - g)
    if a is None:
        # a = -k: the reads are taken back along k, so the chunk writes k^T (v - u) and reads
        # out Q_qk (v - u) (the gated delta rule's pseudo-values), one product each.
        xw = unit_lower_inverse(p_bk) @ rhs
        pseudo, w = v - xw[..., :v.shape[-1]], xw[..., v.shape[-1]:]    # v - U = pseudo - w S_0

        @functools.partial(jax.checkpoint, prevent_cse=False)
        def delta_chunk(s, xs):
            pseudo_n, w_n, qg_n, qk_n, t_n, kg_n = xs
            pseudo_n = pseudo_n - w_n @ s
            out = qg_n @ s + qk_n @ pseudo_n
            return jnp.exp(t_n)[:, None] * s + kg_n.T @ pseudo_n, out

        s_end, out = lax.scan(delta_chunk, s0, (pseudo, w, qg, q_k, total, kg))
        return out, s_end
    p_ba, q_a = scores[0, 1], scores[1, 1] + diagonal[1]
    xw = unit_lower_inverse(-p_ba) @ rhs
    x, w = xw[..., :v.shape[-1]], xw[..., v.shape[-1]:]
    inter = q_k @ v
    ag = a * jnp.exp(total[:, None] - g)
    kv = jnp.einsum("ncm,nce->nme", kg, v)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk(s, xs):
        x_n, w_n, qg_n, qa_n, in_n, t_n, ag_n, kv_n = xs
        u = x_n + w_n @ s
        out = qg_n @ s + qa_n @ u + in_n
        return jnp.exp(t_n)[:, None] * s + ag_n.T @ u + kv_n, out

    s_end, out = lax.scan(chunk, s0, (x, w, qg, q_a, inter, total, ag, kv))
    return out, s_end


def dplr_chunked(
    q: Float[Array, "seq m"],
    k: Float[Array, "seq m"],
    v: Float[Array, "seq e"],
    a: Float[Array, "seq m"] | None,
    b: Float[Array, "seq m"],
    ld: Float[Array, "seq m"],
    chunk_size: int = 16,
    sub_chunk: int = 4,
    group_positions: int = GROUP_POSITIONS,
) -> Float[Array, "seq e"]:
    """The same recurrence as :func:`dplr_recurrent`, chunkwise (see the module docstring):
    per chunk, four ``[c, c]`` score matrices over the ``M`` channels (two when ``a`` is None),
    the per-channel decays applied pairwise within sub-chunks and by matrix products across
    them (:func:`_scores`), one unit lower-triangular inverse, then a scan over chunks;
    chunks go in groups through :func:`~._scan.chunk_groups`, rematerialised in the backward
    pass (keeping the score matrices instead, ``2 c`` or ``4 c`` floats per position, was no
    faster on the 2-core EPYC at L=8192 and slower at 65536).

    Args: as :func:`dplr_recurrent`, where ``a = None`` means ``a = -k`` (the delta rule:
    what is written along ``k`` is first removed along it); chunk_size: positions per chunk
    (padding writes nothing and does not decay); sub_chunk: positions per sub-chunk (the
    largest divisor of the chunk not above it); group_positions: positions per group.
    Returns ``[L, E]``.
    """
    s0 = jnp.zeros((k.shape[-1], v.shape[-1]), jnp.result_type(k, v))
    if a is None:
        def chunks(q, k, v, b, ld, s):
            return _dplr_chunks(q, k, v, None, b, ld, s, sub_chunk)

        return chunk_groups(chunks, (q, k, v, b, ld), s0, chunk_size, group_positions)

    def chunks(q, k, v, a, b, ld, s):
        return _dplr_chunks(q, k, v, a, b, ld, s, sub_chunk)

    return chunk_groups(chunks, (q, k, v, a, b, ld), s0, chunk_size, group_positions)
