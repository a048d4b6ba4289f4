"""Log-linear attention: the causal recurrence of :mod:`._scan` with a Fenwick-tree hierarchy
of states (Guo, Yang, Goel, Xing, Dao and Kim, 2025, "Log-Linear Attention").

Linear attention (and Mamba-2) keeps one state, so every past token reaches a query through
the same matrix. Log-linear attention splits the prefix ``[0, t]`` of query ``t`` into
``O(log t)`` buckets of power-of-two sizes (a Fenwick tree) and weighs each bucket's state by
its own data-dependent level weight ``lambda_t^(l)``:

    o_t = sum_{s <= t} lambda_t^(level(t, s)) exp(b_t - b_s) (fq_t . fk_s) v_s,
    level(t, t) = 0,   level(t, s) = floor(log2(t XOR s)) + 1   (s < t),

with ``b = cumsum(ld)`` the cumulative log-decays of the base recurrence (0 for linear
attention, ``dt_t a`` for Mamba-2). Positions count from 0: for ``s < t`` the level is one
more than the highest bit in which ``t`` and ``s`` differ, so the keys of level ``l >= 1``
are the ``2^(l-1)`` positions below ``t`` that share ``t``'s bits above bit ``l - 1`` (bucket
``l`` is empty when that bit of ``t`` is 0). With every ``lambda = 1`` it is the base
recurrence.

Three forms, computing the same function:

- :func:`loglinear_parallel`: the ``L x L`` masked matrix (the reference; quadratic).
- :func:`loglinear_chunked`: chunks of ``C = 2^c`` positions, inside a chunk a dense ``C x C``
  product with the level mask (levels ``0..c`` depend on the in-chunk offsets only), across
  chunks one state per chunk-level bucket (``O(log(L/C))`` states ``[M, E]``) carried by a
  scan over chunks, merged Fenwick-fashion; groups of chunks on :func:`._scan.chunk_groups`.
- :func:`loglinear_recurrent` / :func:`loglinear_step`: token by token with ``O(log L)``
  states (decoding): after token ``t`` the states of the buckets below bit ``z =
  ctz(t + 1)`` and the token's own ``fk_t v_t^T`` merge into bucket ``z``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...kernels import pad_to
from ._scan import _intra_decay, chunk_groups


def num_levels(length: int) -> int:
    """Levels a sequence of ``length`` positions uses: ``0`` (the token itself) to
    ``bit_length(length - 1)``."""
    return max(int(length) - 1, 0).bit_length() + 1


def fenwick_levels(length: int) -> np.ndarray:
    """``int32[L, L]``: ``level(t, s)`` for ``s <= t`` (``-1`` above the diagonal)."""
    t = np.arange(length)[:, None]
    s = np.arange(length)[None, :]
    x = np.bitwise_xor(t, s)
    lev = np.where(x == 0, 0, np.floor(np.log2(np.maximum(x, 1))).astype(np.int64) + 1)
    return np.where(s <= t, lev, -1).astype(np.int32)


def _lambda_columns(lam, needed: int):
    """``lam [..., n]`` with zero columns appended up to ``needed`` (buckets that are empty at
    every query of this length are never read, so their weight does not matter)."""
    extra = needed - lam.shape[-1]
    return lam if extra <= 0 else jnp.pad(lam, [(0, 0)] * (lam.ndim - 1) + [(0, extra)])


def _check(name, fq, fk, v, ld, lam):
    length = fq.shape[0]
    shapes = f"fq{tuple(fq.shape)}, fk{tuple(fk.shape)}, v{tuple(v.shape)}, " \
             f"ld{tuple(ld.shape)}, lam{tuple(lam.shape)}"
    if (fq.ndim != 2 or fk.shape != fq.shape or v.ndim != 2 or v.shape[0] != length
            or ld.shape != (length,) or lam.ndim != 2 or lam.shape[0] != length):
        raise ValueError(f"{name}: needs fq, fk [L, M], v [L, E], ld [L], lam [L, levels]; "
                         f"got {shapes}")
    if lam.shape[1] < num_levels(length):
        raise ValueError(f"{name}: a sequence of {length} positions uses "
                         f"{num_levels(length)} levels (0..{num_levels(length) - 1}), but lam "
                         f"has {lam.shape[1]}; got {shapes}")


def loglinear_parallel(fq, fk, v, ld, lam):
    """Log-linear attention in its quadratic masked form (the paper's ``O = (Q K^T * M^H) V``).

    Args:
      fq, fk: ``[L, M]`` query and key features. v: ``[L, E]``. ld: ``[L]`` log-decays ``<= 0``
        (zeros: log-linear linear attention). lam: ``[L, levels]`` level weights, ``levels >=
        num_levels(L)``.

    Returns:
      ``[L, E]``.
    """
    _check("loglinear_parallel", fq, fk, v, ld, lam)
    length = fq.shape[0]
    lev = jnp.asarray(fenwick_levels(length))
    weight = jnp.where(lev >= 0, lam[jnp.arange(length)[:, None], jnp.maximum(lev, 0)], 0.0)
    b = jnp.cumsum(ld)
    scores = (fq @ fk.T) * _intra_decay(b[None])[0] * weight
    return scores @ v


def _ctz(x):
    """Trailing zeros of a positive int32."""
    return lax.population_count((x & -x) - 1)


def _merge(states, z, kv):
    """Fenwick merge: bucket ``z`` becomes the sum of the buckets below it and ``kv``; those
    buckets empty. ``states [n, M, E]``."""
    idx = jnp.arange(states.shape[0]).reshape(-1, 1, 1)
    merged = jnp.sum(jnp.where(idx < z, states, 0), axis=0) + kv
    return jnp.where(idx == z, merged, jnp.where(idx < z, 0, states))


def loglinear_step(states, t, fq_t, fk_t, v_t, ld_t, lam_t):
    """One token of log-linear attention (decoding).

    Args:
      states: ``[n, M, E]``, the buckets of position ``t`` (``n >= bit_length(T)`` for ``T``
        positions in all). t: the int32 position. fq_t, fk_t: ``[M]``. v_t: ``[E]``.
      ld_t: scalar log-decay. lam_t: ``[levels]``.

    Returns:
      ``(out_t [E], states for t + 1)``.
    """
    states = jnp.exp(ld_t) * states
    lam_t = _lambda_columns(lam_t, states.shape[0] + 1)
    own = lam_t[0] * jnp.dot(fq_t, fk_t) * v_t
    out = own + jnp.einsum("m,nme,n->e", fq_t, states, lam_t[1: states.shape[0] + 1])
    return out, _merge(states, _ctz(t + 1), fk_t[:, None] * v_t[None, :])


def loglinear_recurrent(fq, fk, v, ld, lam):
    """:func:`loglinear_parallel` by :func:`loglinear_step` over positions (``O(log L)``
    states)."""
    _check("loglinear_recurrent", fq, fk, v, ld, lam)
    length = fq.shape[0]
    s0 = jnp.zeros((max(length.bit_length(), 1), fk.shape[1], v.shape[1]),
                   jnp.result_type(fk, v))

    def step(s, x):
        out, s = loglinear_step(s, *x)
        return s, out

    return lax.scan(step, s0, (jnp.arange(length, dtype=jnp.int32), fq, fk, v, ld, lam))[1]


@functools.partial(jax.checkpoint, prevent_cse=False)
def _intra(fq, fk, v, b, lam, onehot):
    """Within-chunk outputs with the level mask: ``lam [n, C, c + 1]``, ``onehot [C, c + 1,
    C]`` (``onehot[t, l, s]``: key ``s`` is at level ``l`` of query ``t``)."""
    # The level weights spread by a product with the one-hot levels, not a gather: a gather's
    # gradient is a scatter, which XLA:CPU runs element by element.
    weight = jnp.einsum("ntl,tls->nts", lam, onehot)
    scores = jnp.einsum("ncm,ndm->ncd", fq, fk) * _intra_decay(b) * weight
    return jnp.einsum("ncd,nde->nce", scores, v)


def _chunks(fq, fk, v, ld, lam, first, states, *, onehot, bits):
    """A group of ``n`` chunks from the chunk-level bucket ``states [nb, M, E]`` at its start:
    ``(out [n, C, E], states)``. ``first [n, C]`` holds each position (its chunk's index is
    ``first[:, 0] // C``)."""
    c = onehot.shape[0]
    b = jnp.cumsum(ld, axis=1)
    total = b[:, -1]
    kv = jnp.einsum("ncm,nce->nme", fk, v * jnp.exp(total[:, None] - b)[..., None])

    def carry(s, x):
        total_n, kv_n, chunk = x
        return _merge(jnp.exp(total_n) * s, _ctz(chunk + 1), kv_n), s

    states, starts = lax.scan(carry, states, (total, kv, first[:, 0] // c))
    nb = states.shape[0]
    lam_inter = lam[..., bits + 1: bits + 1 + nb]
    # fq against every level's state first ([n, C, nb, E]); contracted the other way round
    # the weights would spread each state over the chunk's positions ([n, C, M, E]).
    per_level = jnp.einsum("ncm,nbme->ncbe", fq, starts)
    inter = jnp.einsum("ncbe,ncb->nce", per_level, lam_inter) * jnp.exp(b)[..., None]
    return inter + _intra(fq, fk, v, b, lam[..., : bits + 1], onehot), states


def loglinear_chunked(fq, fk, v, ld, lam, chunk_size: int = 64,
                      group_positions: int | None = None):
    """:func:`loglinear_parallel` chunkwise (the paper's chunked algorithm): time
    ``O(L C (M + E) + L M E log(L / C))``, memory ``O(L (M + E) + (L / C) M E log(L / C))``
    per group of chunks.

    Args:
      fq, fk, v, ld, lam: as :func:`loglinear_parallel`.
      chunk_size: ``C``, a power of two (the in-chunk levels are those of the offsets); a
        sequence shorter than it runs as one chunk of the next power of two.
      group_positions: positions per group of chunks (:func:`._scan.chunk_groups`; default
        its ``GROUP_POSITIONS``).

    Returns:
      ``[L, E]``.
    """
    name = "loglinear_chunked"
    _check(name, fq, fk, v, ld, lam)
    if not (isinstance(chunk_size, int) and chunk_size > 0 and chunk_size & (chunk_size - 1) == 0):
        raise ValueError(f"{name}: chunk_size must be a power of two (the Fenwick levels inside "
                         f"a chunk are those of the in-chunk offsets), got {chunk_size!r}")
    length = fq.shape[0]
    c = min(chunk_size, 1 << max(length - 1, 0).bit_length())
    bits = c.bit_length() - 1
    padded = -(-length // c) * c
    nb = max((padded // c).bit_length(), 1)
    lam = _lambda_columns(lam, bits + 1 + nb)
    arrays = [pad_to(a, padded) for a in (fq, fk, v, ld, lam)]
    arrays.append(jnp.arange(padded, dtype=jnp.int32))
    s0 = jnp.zeros((nb, fk.shape[1], v.shape[1]), jnp.result_type(fk, v))
    lev = fenwick_levels(c)
    onehot = (lev[:, None, :] == np.arange(bits + 1)[None, :, None]).astype(np.float32)
    fn = functools.partial(_chunks, onehot=jnp.asarray(onehot, jnp.result_type(fq, lam)),
                           bits=bits)
    kw = {} if group_positions is None else {"group_positions": group_positions}
    return chunk_groups(fn, arrays, s0, c, **kw)[:length]
