"""Adaptive attention span: a learnable soft limit on how far back each head looks.

Sukhbaatar, Grave, Bojanowski & Joulin, "Adaptive Attention Span in Transformers" (ACL 2019).

The soft mask ``m_z(x) = clamp((R + z - x) / R, 0, 1)`` of the distance ``x = i - j`` (R the
ramp, z the learnable span) multiplies the attention weights before renormalisation, which is
softmax with the additive bias ``log m_z(x)``. Keys beyond ``max_span + ramp`` always get
weight zero, so the attention runs as block-sparse attention over a band of that width: the
cost is proportional to the maximum span, not the sequence length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._exact import block_sparse_attention
from ..patterns import Local


class _SpanBias:
    """``log m_z(|i - j|)`` as a bias callable (a pytree, so gradients reach ``span``)."""

    def __init__(self, span, ramp, max_span):
        self.span, self.ramp, self.max_span = span, ramp, max_span

    def __call__(self, q_pos, k_pos):
        z = jnp.clip(self.span.astype(jnp.float32), 0.0, self.max_span)
        m = jnp.clip((self.ramp + z - jnp.abs(q_pos - k_pos).astype(jnp.float32)) / self.ramp, 0.0, 1.0)
        return jnp.where(m > 0, jnp.log(jnp.where(m > 0, m, 1.0)), -jnp.inf)


jax.tree_util.register_pytree_node(
    _SpanBias,
    lambda b: ((b.span,), (b.ramp, b.max_span)),
    lambda aux, children: _SpanBias(children[0], *aux),
)


def adaptive_span_penalty(span, max_span: int):
    """The span loss term for one or more heads: the sum of the spans (clamped to
    ``[0, max_span]``) divided by ``max_span``; multiply by the paper's coefficient."""
    return jnp.sum(jnp.clip(jnp.asarray(span, jnp.float32), 0.0, max_span)) / max_span


def adaptive_span_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    span,
    *,
    max_span: int,
    ramp: int = 32,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale: float | None = None,
    block_size: int | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Softmax attention with a learnable soft span for one sequence and one head.

    Weights are ``m_z(|i - j|) exp(s_ij)`` renormalised, with ``m_z(x) = clamp((ramp + z - x)
    / ramp, 0, 1)`` and ``z = clamp(span, 0, max_span)``. With ``causal=True`` only past keys
    count (the paper's language-model setting); otherwise the span is symmetric. Gradients
    reach ``span``; add :func:`adaptive_span_penalty` to the loss. Per-head spans come through
    ``multihead(..., arg_axes=("heads",))``.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      span: scalar array, the learnable span z (in tokens).
      max_span: static upper bound S of the span; the work is O(L * (S + ramp)).
      ramp: the soft ramp length R (> 0).
      causal: query i sees keys j <= i only.
      kv_mask: ``bool[Lk]``, True for real keys.
      segment_ids: packed-sequence ids (the span is a distance ``|i - j|``, so each document
        gets its own).
      scale: score scale, ``1/sqrt(Dk)`` by default.
      block_size: tile size of the block-sparse band (default: fits the band).

    Returns:
      ``[Lq, Dv]`` in q's dtype.
    """
    name = "adaptive_span_attention"
    max_span = C.check_positive_int(name, "max_span", max_span)
    ramp = C.check_positive_int(name, "ramp", ramp)
    span = jnp.asarray(span)
    if span.ndim:
        raise ValueError(
            f"{name}: span must be a scalar (one head; map heads with multihead) but has shape "
            f"{span.shape}"
        )
    reach = max_span + ramp
    block = block_size or min(512, max(16, 1 << (reach - 1).bit_length()))
    band = Local(reach, 0 if causal else reach)
    return block_sparse_attention(
        q, k, v, band, causal=causal, kv_mask=kv_mask, segment_ids=segment_ids, scale=scale,
        bias=_SpanBias(span, float(ramp), float(max_span)), block_q=block, block_k=block,
    )
