"""Sort, chunk and unsort: the machinery content-based attention (LSH, routing) shares.

Positions are sorted by an integer code (bucket or cluster first, then position), the sorted
sequence is cut into contiguous chunks, and each chunk of queries attends to its own chunk and
the previous one (Reformer, Kitaev et al. 2020). Scores live only in
``[num_chunks, chunk, 2 * chunk]`` tiles, so memory is O(L * chunk). The caller supplies the
pair mask and score corrections from per-position metadata, so the same code serves every
hashing or clustering rule. Partial results (LSH's hash rounds) are merged by their
log-sum-exps with the kernel layer's ``merge_all_by_lse``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._contract import STATS_DTYPE
from ... import kernels


@functools.partial(jax.custom_vjp, nondiff_argnums=())
def permute(x, perm, inverse):
    """``x[perm]`` whose gradient is the gather ``g[inverse]`` instead of a scatter-add.

    ``perm`` must be a permutation of ``range(len(x))`` and ``inverse`` its inverse.
    """
    return x[perm]


def _permute_fwd(x, perm, inverse):
    return x[perm], (perm, inverse)


def _permute_bwd(res, g):
    perm, inverse = res
    return g[inverse], None, None


permute.defvjp(_permute_fwd, _permute_bwd)


def sort_by_code(codes):
    """``(perm, inverse)`` for sorting int32 ``codes [L]`` ascending (ties by index).

    ``perm[s]`` is the original position at sorted index s; ``inverse[p]`` the sorted index of
    original position p.
    """
    perm = jnp.argsort(codes, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=jnp.int32))
    return perm, inverse


def with_previous_chunk(x, chunk: int, fill):
    """``x [n * chunk, ...] -> [n, 2 * chunk, ...]``: each chunk preceded by the previous one.

    Chunk 0 is preceded by ``fill`` (it has no previous chunk; Reformer's wrap-around would
    make a single chunk attend to itself twice).
    """
    n = x.shape[0] // chunk
    xc = x.reshape(n, chunk, *x.shape[1:])
    first = jnp.full((1, chunk, *x.shape[1:]), fill, x.dtype)
    prev = jnp.concatenate([first, xc[:-1]], axis=0)
    return jnp.concatenate([prev, xc], axis=1)


def chunk_attention(q_s, k_s, v_s, score_fn, *, chunk: int, scale: float):
    """Softmax attention of each sorted chunk of queries over its own and the previous chunk.

    Args:
      q_s: ``[Lp, Dk]`` sorted queries, ``Lp`` a multiple of ``chunk``.
      k_s: ``[Lp, Dk]`` sorted keys. v_s: ``[Lp, Dv]`` sorted values.
      score_fn: ``score_fn(s) -> s'`` applied to the scaled float32 scores ``[n, chunk,
        2 * chunk]`` (keys ordered as ``with_previous_chunk``): it masks (-inf) and corrects.
      chunk: chunk length. scale: score scale.

    Returns:
      ``(out f32[Lp, Dv], lse f32[Lp])`` in sorted order; rows that see nothing give zeros and
      ``lse = -inf``.
    """
    n = q_s.shape[0] // chunk
    qc = q_s.reshape(n, chunk, -1)
    kc = with_previous_chunk(k_s, chunk, 0)
    vc = with_previous_chunk(v_s, chunk, 0)
    s = jnp.einsum("ncd,nkd->nck", qc, kc, preferred_element_type=STATS_DTYPE) * scale
    s = score_fn(s)
    m = jax.lax.stop_gradient(kernels.safe_max(jnp.max(s, axis=-1)))
    p = jnp.exp(s - m[..., None])
    l = p.sum(axis=-1)
    acc = jnp.einsum("nck,nkd->ncd", p.astype(v_s.dtype), vc, preferred_element_type=STATS_DTYPE)
    out = kernels.normalise(acc, l)
    return out.reshape(n * chunk, -1), kernels.log_sum_exp(m, l).reshape(n * chunk)


def pack_bits(member):
    """``bool[K, L] -> uint32[L, ceil(K / 32)]``: bit c of a position's word says it is in c."""
    k, length = member.shape
    words = -(-k // 32)
    padded = jnp.zeros((words * 32, length), bool).at[:k].set(member)
    bits = padded.reshape(words, 32, length).astype(jnp.uint32)
    shifts = jnp.arange(32, dtype=jnp.uint32)[None, :, None]
    return jnp.sum(bits << shifts, axis=1, dtype=jnp.uint32).T


def shared_count(bits_a, bits_b):
    """How many sets two positions share, from ``pack_bits`` words ``[..., W]`` each."""
    both = bits_a & bits_b
    return jnp.sum(jax.lax.population_count(both).astype(jnp.int32), axis=-1)
