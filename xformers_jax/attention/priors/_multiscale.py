"""Multi-scale heads (Guo et al., 2020, "Multi-Scale Self-Attention for Text
Classification"): head ``h`` sees only the keys within its scale ``w_h`` of the query,
``|i - j| <= w_h`` (``j in [i - w_h, i]`` when causal), so heads look at different spans. Runs
on the block-sparse kernel, heads of one scale together
(:func:`~xformers_jax.attention.per_head_block_sparse_attention`): the work is the sum of each
head's band.
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import _contract as C
from .. import patterns as P
from ..sparse import per_head_block_sparse_attention


def multiscale_patterns(spans, causal: bool) -> P.PerHead:
    """One pattern per head: ``Local(w, w)`` (``Local(w, 0)`` when causal) or Full for
    ``w = None``."""
    out = []
    for w in spans:
        if w is None:
            out.append(P.Causal() if causal else P.Full())
        else:
            w = C.check_positive_int("multiscale_attention", "each span", w)
            out.append(P.Local(w, 0 if causal else w))
    return P.PerHead(tuple(out))


def multiscale_attention(q, k, v, *, spans, causal=False, kv_mask=None, segment_ids=None,
                         scale=None, key=None, block_q=None, block_k=None):
    """Softmax attention with a span per head.

    Args:
      q: ``[L, H, Dk]``. k: ``[L, H, Dk]``. v: ``[L, H, Dv]``.
      spans: ``H`` entries, each a positive int ``w`` (keys within ``w`` positions) or None
        (all keys).
      causal, kv_mask (``bool[L]``), scale, key, block_q, block_k: the contract and the tiles.
      segment_ids: packed-sequence ids ``int[L]``: the spans are offsets ``i - j``, so inside
        its document each query sees what it sees alone.

    Returns:
      ``[L, H, Dv]``.
    """
    name = "multiscale_attention"
    spans = tuple(spans)
    q = jnp.asarray(q)
    if q.ndim != 3 or len(spans) != q.shape[1]:
        raise ValueError(f"{name}: one span per head: got {len(spans)} spans {spans} for q of "
                         f"shape {q.shape} ([L, H, Dk])")
    return per_head_block_sparse_attention(q, k, v, multiscale_patterns(spans, causal),
                                           causal=causal, kv_mask=kv_mask,
                                           segment_ids=segment_ids, scale=scale,
                                           block_q=block_q, block_k=block_k)
