"""Exact top-k attention: each query keeps its k highest-scoring keys.

A content-based ("adaptive") sparsification of softmax attention (Gupta et al.,
"Memory-efficient Transformers via Top-k Attention", 2021). The scores are computed
densely, so the saving is in the weights, not in the cost.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from ... import kernels


def topk_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *,
    top_k: int,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale: float | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Softmax attention over each query's ``top_k`` best visible keys.

    Keys whose score ties the k-th best are all kept. With ``top_k >= Lk`` this is
    :func:`dot_product_attention`. Masked (``kv_mask``) and future (``causal``) keys are never
    selected; a query with fewer visible keys keeps them all.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      top_k: keys kept per query.
      causal: query i sees keys j <= i only.
      kv_mask: ``bool[Lk]``, True for real keys.
      segment_ids: packed-sequence ids ``int[L]`` or a ``(q, kv)`` pair: a query chooses
        among its own document's keys only.
      scale: score scale, ``1/sqrt(Dk)`` by default.

    Returns:
      ``[Lq, Dv]`` in q's dtype.
    """
    name = "topk_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    top_k = C.check_positive_int(name, "top_k", top_k)
    scale = C.resolve_scale(x.dk, scale)
    s = jnp.einsum("qd,kd->qk", x.q, x.k, preferred_element_type=C.STATS_DTYPE) * scale
    if kv_mask is not None:
        s = jnp.where(kv_mask[None, :], s, -jnp.inf)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape, bool)), s, -jnp.inf)
    segs = C.check_segment_ids(name, segment_ids, x.lq, x.lk)
    if segs is not None:
        s = jnp.where(segs[0][:, None] == segs[1][None, :], s, -jnp.inf)
    if top_k < x.lk:
        kth = jax.lax.stop_gradient(jax.lax.top_k(s, top_k)[0][:, -1:])
        s = jnp.where(s >= kth, s, -jnp.inf)
    m = jax.lax.stop_gradient(kernels.safe_max(s.max(-1)))
    p = jnp.exp(s - m[:, None])
    out = jnp.einsum("qk,kd->qd", p.astype(x.v.dtype), x.v, preferred_element_type=C.STATS_DTYPE)
    return kernels.normalise(out, p.sum(-1)).astype(x.q.dtype)
