"""Log-linear attention over two bases (Guo et al., 2025, "Log-Linear Attention"): one state
per head replaced by the Fenwick-tree hierarchy of ``O(log L)`` states, each read with a
data-dependent level weight ``lambda_t^(l)`` (:mod:`xformers_jax.attention.linear._loglinear`):

- log-linear Mamba-2 (Section 3.3): ``y_t = sum_{s <= t} lambda_t^(level(t, s))
  exp(sum_{s < r <= t} dt_r a) (C_t . B_s) dt_s x_s``; with every ``lambda = 1`` it is
  Mamba-2 (:func:`~xformers_jax.mixers.ssd`);
- log-linear (causal, unnormalised) linear attention: ``o_t = sum_{s <= t}
  lambda_t^(level(t, s)) (q_t . k_s) v_s``; with every ``lambda = 1`` it is linear attention's
  recurrence without decay (:func:`~xformers_jax.mixers.linear_recurrence` with ``ld = 0``).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..attention.linear import (loglinear_chunked, loglinear_parallel, loglinear_recurrent,
                                num_levels)
from ._recurrences import _check, _check_2d, _f32, _mask

# Positions per chunk of the chunked form. fwd+bwd of 4 heads of 64 at L=8192 (the modern
# suite's log-linear Mamba-2), interleaved in one process on the shared 2-core machine:
# chunks of 128 took 0.85 of the time of chunks of 64 (process CPU time 0.53 s against
# 0.63 s; 256 took longer again in wall time), and log-linear linear attention's 0.87: the per-chunk
# Fenwick merges and level reads (log2(L / C) states each) halve, the dense C x C products
# inside a chunk double.
LOGLINEAR_CHUNK = 128


def _forms(name, fq, fk, v, ld, lam, kv_mask, implementation, chunk_size):
    if lam.shape[1] < num_levels(fq.shape[0]):
        raise ValueError(f"{name}: lam must have at least {num_levels(fq.shape[0])} level "
                         f"columns for L={fq.shape[0]}, got shape {lam.shape}")
    if kv_mask is not None:
        lam = jnp.where(kv_mask[:, None], lam, 0)
    if implementation == "parallel":
        return loglinear_parallel(fq, fk, v, ld, lam)
    if implementation == "recurrent":
        return loglinear_recurrent(fq, fk, v, ld, lam)
    return loglinear_chunked(fq, fk, v, ld, lam, chunk_size)


def loglinear_ssd(x, dt, a, b, c, lam, *, kv_mask=None, implementation: str = "chunked",
                  chunk_size: int = LOGLINEAR_CHUNK):
    """Log-linear Mamba-2 of one head (Guo et al., 2025).

    Args:
      x: ``[L, P]`` the head's inputs. dt: ``[L]`` step sizes ``> 0``. a: scalar ``< 0``.
      b, c: ``[L, N]`` input and output projections of the state.
      lam: ``[L, levels]`` level weights (``levels >= num_levels(L) = bit_length(L - 1) + 1``;
        level 0 is the token itself).
      kv_mask: ``bool[L]`` or None: padded positions write nothing, decay nothing and read
        nothing. The Fenwick levels are over positions, so padding at the end of a row changes
        no real output; padding in the middle shifts the levels of the later tokens.
      implementation: ``"chunked"`` (the paper's chunkwise algorithm; ``chunk_size`` a power of
        two), ``"parallel"`` (the ``L x L`` masked form) or ``"recurrent"`` (token by token,
        ``O(log L)`` states).

    Returns:
      ``[L, P]`` float32 (without the skip term ``D x``).
    """
    name = "loglinear_ssd"
    _check(name, implementation, chunk_size)
    length = _check_2d(name, x=x, b=b, c=c, lam=lam)
    if dt.shape != (length,):
        raise ValueError(f"{name}: dt must be [{length}], got shape {dt.shape}")
    x, dt, b, c, lam = _f32(x, dt, b, c, lam)
    fk, v, ld = _mask(name, kv_mask, length, b, x * dt[:, None], dt * a)
    return _forms(name, c, fk, v, ld, lam, kv_mask, implementation, chunk_size)


def loglinear_linear(q, k, v, lam, *, kv_mask=None, implementation: str = "chunked",
                     chunk_size: int = LOGLINEAR_CHUNK):
    """Log-linear linear attention of one head (Guo et al., 2025): ``o_t = sum_{s <= t}
    lambda_t^(level(t, s)) (q_t . k_s) v_s`` (causal, no feature map, no normaliser, no decay).

    Args:
      q, k: ``[L, Dk]`` (k already scaled). v: ``[L, Dv]``. lam: ``[L, levels]`` level weights
        as :func:`loglinear_ssd`'s. kv_mask, implementation, chunk_size: as
        :func:`loglinear_ssd`.

    Returns:
      ``[L, Dv]`` float32.
    """
    name = "loglinear_linear"
    _check(name, implementation, chunk_size)
    length = _check_2d(name, q=q, k=k, v=v, lam=lam)
    q, k, v, lam = _f32(q, k, v, lam)
    k, v, ld = _mask(name, kv_mask, length, k, v, jnp.zeros((length,), jnp.float32))
    return _forms(name, q, k, v, ld, lam, kv_mask, implementation, chunk_size)
