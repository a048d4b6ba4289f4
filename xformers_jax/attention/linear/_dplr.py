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

Packed documents (``segment_ids``): the state restarts from zero at each document's first
token. In the chunked form every score pairing two documents is masked out, the carried-in
``S_0`` reaches only the chunk's positions in the document of its previous token, and the
state written out comes from the chunk's last document alone (as in :mod:`._delta`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from ._delta import _kept, document_masks, document_starts, unit_lower_inverse
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
    segment_ids=None,
) -> Float[Array, "seq e"]:
    """The generalised delta rule by a per-step scan (the reference form).

    Args:
      q, k, b: ``[L, M]``. a: ``[L, M]``, or None for ``a = -k``. v: ``[L, E]``.
      ld: ``[L, M]`` log-decays ``<= 0``.
      segment_ids: ``int[L]`` packed documents (contiguous ids), or None: the state restarts
        from zero at each document's first position.

    Returns:
      ``[L, E]``.
    """
    a = -k if a is None else a
    init = jnp.zeros((k.shape[1], v.shape[1]), jnp.result_type(k, v))
    if segment_ids is None:
        def step(s, x):
            return dplr_step(s, *x)[::-1]

        return lax.scan(step, init, (q, k, v, a, b, ld))[1]

    def reset_step(s, x):
        start, *x = x
        return dplr_step(jnp.where(start, jnp.zeros_like(s), s), *x)[::-1]

    return lax.scan(reset_step, init, (document_starts(segment_ids), q, k, v, a, b, ld))[1]


class _Scores:
    """The ``[n, c, c]`` matrices ``sum_m x_tm y_jm exp(gx_tm - gy_jm)`` for ``j < t`` of a
    chunk, for several ``(x, y)`` sharing ``(gx, gy)``.

    Within sub-chunks of ``s`` positions the per-channel decays are applied pairwise (an
    ``[s, s, M]`` product: exact for any decay). Across sub-chunks a pair factorises through
    the reference ``ref_I`` (``gx_t <= ref_I <= gy_j`` for ``t`` in sub-chunk ``I`` and ``j``
    before it): ``exp(gx_t - ref_I) exp(ref_I - gy_j)``, both factors ``<= 1``, so the
    product is a matrix multiplication and no exponent is positive. The secondary chunking
    of Yang et al. (2024, GLA, Sec. 4.2), which keeps the ``[c, c, M]`` work to ``s/c`` of it.
    """

    def __init__(self, gx, gy, ref, sub):
        n, c, m = gx.shape
        self.shape = (n, c // sub, sub, m)
        gxb, gyb = gx.reshape(self.shape), gy.reshape(self.shape)
        mask = jnp.tril(jnp.ones((sub, sub), bool), -1)[..., None]
        diff = gxb[:, :, :, None] - gyb[:, :, None]
        # The inner wheres keep exp off the positive exponents the masks drop (their overflow
        # would turn the masked-out gradient into NaN).
        self.decay = jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)
        self.x_scale = jnp.exp(gxb - ref[:, :, None])
        before = (jnp.arange(c)[None, :] < (jnp.arange(c // sub) * sub)[:, None])[None, ..., None]
        self.y_scale = jnp.where(before, jnp.exp(jnp.where(before, ref[:, :, None] - gy[:, None],
                                                           0.0)), 0.0)

    def __call__(self, x, y):
        n, ns, sub, m = self.shape
        xb, yb = x.reshape(self.shape), y.reshape(self.shape)
        # One contraction rather than a broadcast product and a sum: the latter's gradient,
        # vmapped with a size-1 batch or head axis, segfaulted XLA:CPU (jaxlib 0.10.2).
        inner = jnp.einsum("nism,nitm,nistm->nist", xb, yb, self.decay)
        across = jnp.einsum("nism,nijm->nisj", xb * self.x_scale, y[:, None] * self.y_scale)
        inner = jnp.einsum("nist,ij->nisjt", inner, jnp.eye(ns, dtype=inner.dtype))
        return (across + inner.reshape(across.shape)).reshape(n, ns * sub, ns * sub)


def _dplr_chunks(q, k, v, a, b, ld, s0, sub_chunk=2, starts=None):
    """The chunkwise generalised delta rule over ``n`` chunks (``[n, c, ...]`` arrays) from the
    state ``s0``: (out ``[n, c, E]``, final state). See the module docstring. ``a = None`` is
    the delta rule's ``a = -k``, whose score matrices are those of ``k`` negated. ``starts
    bool[n, c]``: document starts (packed documents), or None."""
    c = v.shape[1]
    sub = math.gcd(c, sub_chunk)
    g = jnp.cumsum(ld, axis=1)
    p = g - ld
    ref = p[:, ::sub]  # each sub-chunk's decay before its first position
    reads = _Scores(p, g, ref, sub)
    carried = last = ends = None
    if starts is not None:
        # Packed documents: masks on the chunk's own matrices (no -inf decays).
        same, carried, last = document_masks(starts)
        carried, last, ends, unmasked = carried[..., None], last[..., None], carried[:, -1:], reads

        def reads(x, y):
            return jnp.where(same, unmasked(x, y), 0.0)

    # The outputs' scores exp(g_t - g_j) are the reads' exp(p_t - g_j) scaled by exp(ld_t) <= 1
    # for j < t, and 1 for j = t: one set of decays serves both.
    qd = q * jnp.exp(ld)

    def outs(y):
        return reads(qd, y) + jnp.sum(q * y, -1)[..., None] * jnp.eye(c, dtype=q.dtype)

    p_bk, q_k = reads(b, k), outs(k)
    qg = q * _kept(jnp.exp(g), carried)
    total = g[:, -1]
    kg = k * _kept(jnp.exp(total[:, None] - g), last)
    if a is None:
        # a = -k: the reads are taken back along k, so the chunk writes k^T (v - u) and reads
        # out Q_qk (v - u) (the gated delta rule's pseudo-values), one product each.
        # U = x + w S_0 with [x, w] = (I + P_bk)^-1 [P_bk V, b * exp(p)]: one product.
        xw = unit_lower_inverse(p_bk) @ jnp.concatenate([p_bk @ v,
                                                         b * _kept(jnp.exp(p), carried)], -1)
        pseudo, w = v - xw[..., :v.shape[-1]], xw[..., v.shape[-1]:]    # v - U = pseudo - w S_0

        @functools.partial(jax.checkpoint, prevent_cse=False)
        def delta_chunk(s, xs):
            pseudo_n, w_n, qg_n, qk_n, t_n, e_n, kg_n = xs
            pseudo_n = pseudo_n - w_n @ s
            out = qg_n @ s + qk_n @ pseudo_n
            return _kept(jnp.exp(t_n), e_n)[:, None] * s + kg_n.T @ pseudo_n, out

        s_end, out = lax.scan(delta_chunk, s0, (pseudo, w, qg, q_k, total, ends, kg))
        return out, s_end
    p_ba, q_a = reads(b, a), outs(a)
    inverse = unit_lower_inverse(-p_ba)
    w = inverse @ (b * _kept(jnp.exp(p), carried))                   # U = x + w S_0
    x = inverse @ (p_bk @ v)
    inter = q_k @ v
    # The chunk writes a^T U + k^T V (decayed to its end) as one product of [a; k]^T [U; V]:
    # a precomputed k^T V would be an [M, E] array per chunk, read and written through memory.
    agk = jnp.concatenate([a * _kept(jnp.exp(total[:, None] - g), last), kg], 1)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk(s, xs):
        x_n, w_n, qg_n, qa_n, in_n, t_n, e_n, agk_n, v_n = xs
        u = x_n + w_n @ s
        out = qg_n @ s + qa_n @ u + in_n
        return (_kept(jnp.exp(t_n), e_n)[:, None] * s
                + agk_n.T @ jnp.concatenate([u, v_n]), out)

    s_end, out = lax.scan(chunk, s0, (x, w, qg, q_a, inter, total, ends, agk, v))
    return out, s_end


def dplr_chunked(
    q: Float[Array, "seq m"],
    k: Float[Array, "seq m"],
    v: Float[Array, "seq e"],
    a: Float[Array, "seq m"] | None,
    b: Float[Array, "seq m"],
    ld: Float[Array, "seq m"],
    chunk_size: int = 8,
    sub_chunk: int = 2,
    group_positions: int = GROUP_POSITIONS,
    segment_ids=None,
) -> Float[Array, "seq e"]:
    """The same recurrence as :func:`dplr_recurrent`, chunkwise (see the module docstring):
    per chunk, four ``[c, c]`` score matrices over the ``M`` channels (two when ``a`` is None),
    the per-channel decays applied pairwise within sub-chunks and by matrix products across
    them (:class:`_Scores`), one unit lower-triangular inverse, then a scan over chunks;
    chunks go in groups through :func:`~._scan.chunk_groups`, rematerialised in the backward
    pass.

    Args: as :func:`dplr_recurrent`, where ``a = None`` means ``a = -k`` (the delta rule:
    what is written along ``k`` is first removed along it); chunk_size: positions per chunk
    (padding writes nothing and does not decay); sub_chunk: positions per sub-chunk (the
    largest divisor of the chunk not above it); group_positions: positions per group;
    segment_ids: ``int[L]`` packed documents, or None (the state restarts at each document's
    first position: masks on the chunks' own matrices, see the module docstring).
    Returns ``[L, E]``.
    """
    s0 = jnp.zeros((k.shape[-1], v.shape[-1]), jnp.result_type(k, v))
    arrays = (q, k, v, b, ld) if a is None else (q, k, v, a, b, ld)
    if segment_ids is not None:
        # Each position's start flag travels with it through the chunking.
        arrays = (*arrays, document_starts(segment_ids))

    def chunks(*xs):
        *xs, s = xs
        starts = xs.pop() if segment_ids is not None else None
        if a is None:  # a = -k, the delta rule (see _dplr_chunks)
            xs.insert(3, None)
        return _dplr_chunks(*xs, s, sub_chunk, starts)

    return chunk_groups(chunks, arrays, s0, chunk_size, group_positions)
