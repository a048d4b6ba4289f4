"""Reformer's LSH attention: angular hashing, sort by (bucket, position), chunked attention.

Kitaev, Kaiser & Levskaya, "Reformer: The Efficient Transformer" (ICLR 2020); survey P 4.1
(Eq 20-21), T1 3.2.10, L 4.1.2 (Eq 12-13).

Unlike the Long Range Arena code, scores are divided by sqrt(d) (not multiplied), the random
rotations come from an explicit key, chunks are contiguous runs of the sorted sequence, and
rounds are combined through their log-sum-exp with the duplicate-pair correction, so that the
result is exactly softmax attention over the union of the keys each round lets a query see.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from ...kernels import merge_all_by_lse
from ._sorted_chunks import chunk_attention, permute, sort_by_code

# Reformer masks a token's own key with a large finite penalty rather than -inf: it then
# attends to itself only when nothing else is visible (in any round, after combination).
SELF_PENALTY = 1e5


def init_lsh_rotations(key, dim: int, num_buckets: int, num_rounds: int = 1):
    """Random rotations for :func:`lsh_attention`: ``f32[num_rounds, dim, num_buckets // 2]``.

    Each round draws its own Gaussian projection R (Eq 20); the hash is
    ``argmax([x R; -x R])`` (Eq 21). ``num_buckets`` must be even, or 1 (a single bucket, for
    testing: every token then hashes to bucket 0). The same key always gives the same hashes.
    """
    name = "init_lsh_rotations"
    dim = C.check_positive_int(name, "dim", dim)
    num_rounds = C.check_positive_int(name, "num_rounds", num_rounds)
    num_buckets = C.check_positive_int(name, "num_buckets", num_buckets)
    if num_buckets != 1 and num_buckets % 2:
        raise ValueError(f"{name}: num_buckets must be even (or 1) but got {num_buckets}")
    return jax.random.normal(key, (num_rounds, dim, num_buckets // 2), jnp.float32)


def lsh_buckets(x, rotations):
    """Angular LSH buckets ``int32[num_rounds, L]`` of ``x [L, D]`` (Eq 20-21)."""
    rot = jnp.einsum("ld,rdb->rlb", x.astype(jnp.float32), rotations.astype(jnp.float32))
    if rotations.shape[-1] == 0:
        return jnp.zeros(rot.shape[:2], jnp.int32)
    return jnp.argmax(jnp.concatenate([rot, -rot], axis=-1), axis=-1).astype(jnp.int32)


def _check(name, x, rotations, chunk_size):
    C.check_same_length(name, x, "LSH attention shares queries and keys, so Lq must equal Lk")
    rotations = jnp.asarray(rotations)
    if rotations.ndim != 3 or rotations.shape[1] != x.dk:
        raise ValueError(
            f"{name}: rotations must have shape (num_rounds, Dk={x.dk}, num_buckets // 2) "
            f"(from init_lsh_rotations) but got {tuple(rotations.shape)}"
        )
    return rotations, C.check_positive_int(name, "chunk_size", chunk_size)


def lsh_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    rotations,
    *,
    chunk_size: int = 128,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Reformer LSH attention for one sequence and one head.

    Keys are normalised, ``k_j / ||k_j||`` (the paper's shared-QK attention: call it with
    ``k = q``, the shared projection). Positions are hashed by their key in each round, sorted
    by (bucket, position) and cut into contiguous chunks of ``chunk_size``; each query sees
    the keys of its own bucket in its own and the previous chunk, never its own position
    unless nothing else is visible. With ``causal=True`` a query sees same-bucket keys at
    earlier positions within ``chunk_size`` of it in sorted order, that is, its bucket's last
    ``chunk_size`` tokens: unlike fixed chunk boundaries (which depend on how many later tokens
    hash to lower buckets) this set never depends on the future. Padded keys (``kv_mask``) go
    to a bucket of their own and change nothing. Rounds are combined through their
    log-sum-exp with each score corrected by ``-log(number of rounds in which the pair
    meets)``, so the output is softmax attention over the union of the rounds' key sets.

    Time O(rounds * L * (chunk + log L)), memory O(rounds * L * chunk).

    Args:
      q: ``[L, Dk]`` queries. k: ``[L, Dk]`` keys (``k = q`` for shared QK). v: ``[L, Dv]``.
      rotations: ``[num_rounds, Dk, num_buckets // 2]`` from :func:`init_lsh_rotations`.
      chunk_size: sorted chunk length (the sequence is padded to a multiple of it).
      causal: query i sees keys j <= i only.
      kv_mask: ``bool[L]``, True for real tokens.
      scale: score scale, ``1/sqrt(Dk)`` by default.

    Returns:
      ``[L, Dv]`` in q's dtype.
    """
    name = "lsh_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    rotations, chunk = _check(name, x, rotations, chunk_size)
    scale = C.resolve_scale(x.dk, scale)
    length = x.lq
    padded = -(-length // chunk) * chunk
    n_rounds = rotations.shape[0]
    n_buckets = max(1, 2 * rotations.shape[-1])

    def pad(a, value=0):
        return jnp.pad(a, [(0, padded - length)] + [(0, 0)] * (a.ndim - 1), constant_values=value)

    k32 = x.k.astype(jnp.float32)
    k_unit = k32 * jax.lax.rsqrt(jnp.maximum(jnp.sum(k32 * k32, -1, keepdims=True), 1e-12))
    qp, kp, vp = pad(x.q), pad(k_unit.astype(x.k.dtype)), pad(x.v)
    valid = pad(jnp.ones((length,), bool) if kv_mask is None else kv_mask, False)
    positions = jnp.arange(padded, dtype=jnp.int32)

    # Padding (data or length) hashes to an extra last bucket, so real tokens never share a
    # chunk slot with it and their sorted order ignores it.
    buckets = jnp.where(valid[None], lsh_buckets(kp, rotations), n_buckets)
    sorts = [sort_by_code(b * padded + positions) for b in buckets]
    sorted_index = jnp.stack([inv for _, inv in sorts])  # [R, Lp]: original -> sorted

    def meets(r, pos_q, pos_k):
        """Does key pos_k fall in query pos_q's window in round r (bucket and chunk rule)?"""
        same = buckets[r][pos_q] == buckets[r][pos_k]
        sq, sk = sorted_index[r][pos_q], sorted_index[r][pos_k]
        if causal:
            return same & (sq - sk >= 0) & (sq - sk < chunk)
        cq, ck = sq // chunk, sk // chunk
        return same & ((ck == cq) | (ck == cq - 1))

    outs, lses = [], []
    for r, (perm, inverse) in enumerate(sorts):
        pos_s = perm
        prev = jnp.concatenate([jnp.full((chunk,), -1, jnp.int32), pos_s[:-chunk]])
        pos_q = pos_s.reshape(-1, chunk, 1)
        pos_k = jnp.concatenate(
            [prev.reshape(-1, chunk), pos_s.reshape(-1, chunk)], axis=1
        )[:, None, :]
        real_k = (pos_k >= 0) & valid[jnp.maximum(pos_k, 0)]
        pos_k_safe = jnp.maximum(pos_k, 0)

        def score_fn(s, r=r, pos_q=pos_q, pos_k=pos_k_safe, real_k=real_k):
            allowed = real_k & meets(r, pos_q, pos_k)
            if causal:
                allowed &= pos_k <= pos_q
            s = jnp.where(pos_q == pos_k, s - SELF_PENALTY, s)
            if n_rounds > 1:
                count = sum(meets(t, pos_q, pos_k).astype(jnp.float32) for t in range(n_rounds))
                s = s - jnp.log(jnp.maximum(count, 1.0))
            return jnp.where(allowed, s, -jnp.inf)

        out_s, lse_s = chunk_attention(
            permute(qp, perm, inverse), permute(kp, perm, inverse), permute(vp, perm, inverse),
            score_fn, chunk=chunk, scale=scale,
        )
        outs.append(permute(out_s, inverse, perm))
        lses.append(permute(lse_s, inverse, perm))
    out, _ = merge_all_by_lse(outs, lses)
    return out[:length].astype(x.q.dtype)
