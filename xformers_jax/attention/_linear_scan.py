"""The causal linear-attention recurrence, written once, in two agreeing forms.

Every causal linear-attention variant (any feature map, RFA gate, scalar decay, the FAVOR+ key
stabiliser) reduces to one decayed prefix sum (survey L 4.2 Eq 16, L 4.2.2, T1 3.2.13)::

    S_t = exp(ld_t) S_{t-1} + fk_t v_t^T        out_t = fq_t S_t

with ``fq, fk: [L, M]``, ``v: [L, E]`` and log-decays ``ld: [L] <= 0`` (0 means no decay). The
normaliser is the same sum with a column of ones appended to ``v``, so it shares the scan.

- :func:`causal_recurrent`: a ``lax.scan`` over positions with an ``[M, E]`` state. Its custom
  VJP is two scans (recompute the states forwards, accumulate the state cotangent backwards);
  no state is ever recovered by subtracting, so there is no drift over long sequences.
- :func:`causal_chunked`: chunks of ``c`` positions; a masked ``c x c`` matmul inside a chunk
  and the state carried across chunks by a scan, so memory is ``O(L (M + E) + (L/c) M E)``.
  The intra-chunk part is rematerialised in the backward pass.

Decays are applied as differences of within-chunk cumulative log-decays, which are <= 0 for
every pair that is used, so nothing overflows however strong the decay.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _scan_states(fk, v, ld, dout):
    """Recomputes the states forwards, emitting ``S_t dout_t`` (= dL/dfq_t) for each t."""

    def step(s, x):
        k_t, v_t, ld_t, do_t = x
        s = jnp.exp(ld_t) * s + k_t[:, None] * v_t[None, :]
        return s, s @ do_t

    init = jnp.zeros((fk.shape[1], v.shape[1]), fk.dtype)
    return lax.scan(step, init, (fk, v, ld, dout))[1]


@jax.custom_vjp
def causal_recurrent(fq, fk, v, ld):
    """``out_t = fq_t S_t`` with ``S_t = exp(ld_t) S_{t-1} + fk_t v_t^T`` by a per-step scan.

    Args:
      fq: ``[L, M]`` query features.
      fk: ``[L, M]`` key features.
      v: ``[L, E]`` values.
      ld: ``[L]`` log-decays (``<= 0``), applied to the state before position t is added.

    Returns:
      ``[L, E]``.
    """

    def step(s, x):
        q_t, k_t, v_t, ld_t = x
        s = jnp.exp(ld_t) * s + k_t[:, None] * v_t[None, :]
        return s, q_t @ s

    init = jnp.zeros((fk.shape[1], v.shape[1]), fk.dtype)
    return lax.scan(step, init, (fq, fk, v, ld))[1]


def _recurrent_fwd(fq, fk, v, ld):
    return causal_recurrent(fq, fk, v, ld), (fq, fk, v, ld)


def _recurrent_bwd(res, dout):
    fq, fk, v, ld = res
    # Scan 1 (forwards): recompute S_t; dL/dfq_t = S_t dout_t.
    dfq = _scan_states(fk, v, ld, dout)

    # Scan 2 (backwards): G_t = dL/dS_t = fq_t dout_t^T + exp(ld_{t+1}) G_{t+1}.
    ld_next = jnp.concatenate([ld[1:], jnp.zeros((1,), ld.dtype)])

    def back(g, x):
        q_t, do_t, ld_n, k_t, v_t = x
        g = jnp.exp(ld_n) * g + q_t[:, None] * do_t[None, :]
        return g, (g @ v_t, k_t @ g)

    init = jnp.zeros((fq.shape[1], dout.shape[1]), fq.dtype)
    dfk, dv = lax.scan(back, init, (fq, dout, ld_next, fk, v), reverse=True)[1]
    # out_i = sum_{j<=i} exp(C_i - C_j) (fq_i . fk_j) v_j with C = cumsum(ld): C enters as a
    # rescaling of fq_i by exp(C_i) and of fk_j by exp(-C_j), so dL/dC_t = fq_t.dfq_t -
    # fk_t.dfk_t, and dL/dld_s is the sum of dL/dC_t over t >= s.
    dc = jnp.sum(fq * dfq, -1) - jnp.sum(fk * dfk, -1)
    dld = jnp.cumsum(dc[::-1])[::-1]
    return dfq, dfk, dv, dld


causal_recurrent.defvjp(_recurrent_fwd, _recurrent_bwd)


def _pad_to(x, length):
    return jnp.pad(x, [(0, length - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


@functools.partial(jax.checkpoint, prevent_cse=False)
def _intra_chunk(fq, fk, v, b):
    """Within-chunk outputs: ``sum_{j<=t} exp(b_t - b_j) (fq_t . fk_j) v_j`` per chunk."""
    c = fq.shape[1]
    causal = jnp.tril(jnp.ones((c, c), bool))
    diff = b[:, :, None] - b[:, None, :]
    # The inner where keeps exp off the (positive) differences above the diagonal, whose
    # overflow would turn the masked-out gradient into NaN.
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
    scores = jnp.einsum("ncm,ndm->ncd", fq, fk) * decay
    return jnp.einsum("ncd,nde->nce", scores, v)


def causal_chunked(fq, fk, v, ld, chunk_size: int):
    """The same recurrence as :func:`causal_recurrent`, chunkwise parallel.

    Args:
      fq: ``[L, M]``, fk: ``[L, M]``, v: ``[L, E]``, ld: ``[L]`` as in :func:`causal_recurrent`.
      chunk_size: positions per chunk (padded internally; padding adds nothing to the state).

    Returns:
      ``[L, E]``.
    """
    length = fq.shape[0]
    c = min(chunk_size, length)
    n = -(-length // c)
    fq, fk, v, ld = (_pad_to(x, n * c) for x in (fq, fk, v, ld))
    fq, fk, v = (x.reshape(n, c, x.shape[-1]) for x in (fq, fk, v))
    b = jnp.cumsum(ld.reshape(n, c), axis=1)  # within-chunk cumulative log-decay, <= 0
    total = b[:, -1]
    # Each chunk's addition to the state at its end, then the states at chunk starts.
    kv = jnp.einsum("ncm,nce->nme", fk * jnp.exp(total[:, None] - b)[..., None], v)

    def carry(s, x):
        total_n, kv_n = x
        return jnp.exp(total_n) * s + kv_n, s

    init = jnp.zeros(kv.shape[1:], kv.dtype)
    starts = lax.scan(carry, init, (total, kv))[1]
    inter = jnp.einsum("ncm,nme->nce", fq * jnp.exp(b)[..., None], starts)
    out = inter + _intra_chunk(fq, fk, v, b)
    return out.reshape(n * c, -1)[:length]
