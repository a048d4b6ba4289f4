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

import jax
import jax.numpy as jnp
from jax import lax

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


def dplr_recurrent(q, k, v, a, b, ld):
    """The generalised delta rule by a per-step scan (the reference form).

    Args:
      q, k, a, b: ``[L, M]``. v: ``[L, E]``. ld: ``[L, M]`` log-decays ``<= 0``.

    Returns:
      ``[L, E]``.
    """

    def step(s, x):
        return dplr_step(s, *x)[::-1]

    init = jnp.zeros((k.shape[1], v.shape[1]), jnp.result_type(k, v))
    return lax.scan(step, init, (q, k, v, a, b, ld))[1]


def _pair_scores(x, gx, y, gy, mask):
    """``sum_m x_tm y_jm exp(gx_tm - gy_jm)`` where ``mask [c, c]`` holds, else 0: ``[n, c, c]``
    from ``[n, c, M]`` arrays. The inner where keeps exp off the positive differences the mask
    drops (their overflow would turn the masked-out gradient into NaN)."""
    m = mask[..., None]
    diff = gx[:, :, None] - gy[:, None]
    decay = jnp.where(m, jnp.exp(jnp.where(m, diff, 0.0)), 0.0)
    return jnp.sum(x[:, :, None] * y[:, None] * decay, axis=-1)


def _dplr_chunks(q, k, v, a, b, ld, s0):
    """The chunkwise generalised delta rule over ``n`` chunks (``[n, c, ...]`` arrays) from the
    state ``s0``: (out ``[n, c, E]``, final state). See the module docstring."""
    c = v.shape[1]
    g = jnp.cumsum(ld, axis=1)
    p = g - ld
    inclusive = jnp.tril(jnp.ones((c, c), bool))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    inverse = unit_lower_inverse(-_pair_scores(b, p, a, g, strict))
    w = inverse @ (b * jnp.exp(p))                                   # U = x + w S_0
    x = inverse @ (_pair_scores(b, p, k, g, strict) @ v)
    q_a = _pair_scores(q, g, a, g, inclusive)
    inter = _pair_scores(q, g, k, g, inclusive) @ v
    qg = q * jnp.exp(g)
    total = g[:, -1]
    ag = a * jnp.exp(total[:, None] - g)
    kv = jnp.einsum("ncm,nce->nme", k * jnp.exp(total[:, None] - g), v)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk(s, xs):
        x_n, w_n, qg_n, qa_n, in_n, t_n, ag_n, kv_n = xs
        u = x_n + w_n @ s
        out = qg_n @ s + qa_n @ u + in_n
        return jnp.exp(t_n)[:, None] * s + ag_n.T @ u + kv_n, out

    s_end, out = lax.scan(chunk, s0, (x, w, qg, q_a, inter, total, ag, kv))
    return out, s_end


def dplr_chunked(q, k, v, a, b, ld, chunk_size: int = 16,
                 group_positions: int = GROUP_POSITIONS):
    """The same recurrence as :func:`dplr_recurrent`, chunkwise (see the module docstring):
    per chunk, four ``[c, c]`` score matrices over the ``M`` channels (a ``[c, c, M]`` product
    each, as GLA's), one unit lower-triangular inverse, then a scan over chunks; chunks go in
    groups through :func:`~._scan.chunk_groups`, rematerialised in the backward pass.

    Args: as :func:`dplr_recurrent`; chunk_size: positions per chunk (padding writes nothing
    and does not decay; the ``[c, c, M]`` products favour small chunks, as GLA's 16);
    group_positions: positions per group. Returns ``[L, E]``.
    """
    s0 = jnp.zeros((k.shape[-1], v.shape[-1]), jnp.result_type(k, v))
    return chunk_groups(_dplr_chunks, (q, k, v, a, b, ld), s0, chunk_size, group_positions)
