"""Different sparse patterns on different heads (the Sparse Transformer's factorised heads,
Child et al., 2019; BlockBERT's per-head permutations, Qiu et al., 2020), each head
block-sparse."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._exact import block_sparse_attention
from ..patterns import PerHead


def per_head_block_sparse_attention(q, k, v, heads: PerHead, *, causal: bool = False,
                                    kv_mask=None, segment_ids=None, scale: float | None = None,
                                    block_q: int | None = None, block_k: int | None = None,
                                    implementation: str | None = None, key=None):
    """Block-sparse attention with one pattern per head, for one sequence.

    Heads that share a pattern run together under ``jax.vmap`` (one layout each group), so the
    work is the sum of each head's kept tiles. Lift over the batch with ``jax.vmap``.

    Args:
      q: ``[Lq, H, Dk]``. k: ``[Lk, H, Dk]``. v: ``[Lk, H, Dv]``.
      heads: a :class:`~xformers_jax.attention.patterns.PerHead` with ``H`` patterns.
      causal, kv_mask, segment_ids, scale, block_q, block_k, implementation: as in
        :func:`block_sparse_attention` (``kv_mask bool[Lk]``; ``segment_ids`` packed rows).
        With segment ids a pattern of offsets ``i - j`` only (``Local``, ``Strided``) gives
        each document its own pattern; one of absolute positions stays one over the row.

    Returns:
      ``[Lq, H, Dv]``.
    """
    name = "per_head_block_sparse_attention"
    if not isinstance(heads, PerHead):
        raise ValueError(f"{name}: heads must be a patterns.PerHead, got {type(heads).__name__}")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(
            f"{name}: q, k, v must be [length, heads, dim]; got q{q.shape}, k{k.shape}, v{v.shape}"
        )
    if not q.shape[1] == k.shape[1] == v.shape[1] == heads.num_heads:
        raise ValueError(
            f"{name}: {heads.num_heads} patterns but q{q.shape}, k{k.shape}, v{v.shape} have "
            f"{q.shape[1]}, {k.shape[1]}, {v.shape[1]} heads"
        )
    outs, order = [], []
    for pattern, idx in heads.groups():
        def one(qh, kh, vh, pattern=pattern):
            return block_sparse_attention(
                qh, kh, vh, pattern, causal=causal, kv_mask=kv_mask, segment_ids=segment_ids,
                scale=scale,
                block_q=block_q, block_k=block_k, implementation=implementation,
            )

        sel = np.asarray(idx)
        outs.append(jax.vmap(one, in_axes=1, out_axes=1)(q[:, sel], k[:, sel], v[:, sel]))
        order.extend(idx)
    return jnp.concatenate(outs, axis=1)[:, np.argsort(order)]
