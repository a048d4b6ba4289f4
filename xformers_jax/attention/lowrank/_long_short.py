"""Long-Short Transformer: a sliding window plus a dynamic low-rank projection, one softmax.

Zhu et al., "Long-Short Transformer: Efficient Transformers for Language and Vision" (2021).
Long range: ``P = softmax_length(K W_p)`` (``[L, r]``) projects keys and
values to ``r`` slots, ``P^T K`` and ``P^T V``; short range: a sliding window. Each query takes
one softmax over its window and the slots, computed as two exact attentions
(:func:`flash_attention`) merged by their log-sum-exps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from ... import kernels
from .._exact import flash_attention
from ..patterns import Local


def init_long_short_projection(key, dk: int, rank: int, *, dtype=jnp.float32):
    """The dynamic projection ``W_p [dk, rank]``, ``N(0, 1/dk)``."""
    dk = C.check_positive_int("init_long_short_projection", "dk", dk)
    rank = C.check_positive_int("init_long_short_projection", "rank", rank)
    return (dk ** -0.5 * jax.random.normal(key, (dk, rank))).astype(dtype)


def _project(k, v, w_p, real, segment):
    """Per segment of ``segment`` positions: ``P^T K``, ``P^T V`` (``[n_seg * r, D]``) with
    ``P = softmax`` over the segment's real positions, and which slots saw a real key."""
    length, r = k.shape[0], w_p.shape[1]
    pad = -length % segment
    seg = lambda a: jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(
        -1, segment, *a.shape[1:])
    logits = seg(jnp.einsum("ld,dr->lr", k, w_p, preferred_element_type=C.STATS_DTYPE))
    real_s = seg(real)[..., None]
    m = jax.lax.stop_gradient(
        kernels.safe_max(jnp.where(real_s, logits, -jnp.inf).max(1, keepdims=True)))
    p = jnp.where(real_s, jnp.exp(logits - m), 0.0)
    p = p / jnp.maximum(p.sum(1, keepdims=True), jnp.finfo(C.STATS_DTYPE).tiny)
    pk = jnp.einsum("slr,sld->srd", p, seg(k).astype(C.STATS_DTYPE)).reshape(-1, k.shape[1])
    pv = jnp.einsum("slr,sld->srd", p, seg(v).astype(C.STATS_DTYPE)).reshape(-1, v.shape[1])
    valid = jnp.repeat(seg(real).any(1), r)
    return pk, pv, valid


def long_short_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    w_p,
    *,
    window: int,
    causal: bool = False,
    segment_size: int | None = None,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Long-Short attention for one sequence and one head.

    Non-causal: query i sees keys ``|i - j| <= window`` and the ``r`` slots projected from the
    whole sequence. Causal (the paper's segment-wise form): the window is ``i - window <= j <=
    i`` and the projection is made per segment of ``segment_size`` tokens; query i sees only
    the slots of segments that end before its own segment starts, so nothing of the future.
    The paper's projection reads the layer input; here it reads the keys (a module can pass
    any ``[L, Dk]`` projection of the input as ``k``).

    Args:
      q: ``[L, Dk]``. k: ``[L, Dk]``. v: ``[L, Dv]`` (self-attention).
      w_p: ``[Dk, r]`` the dynamic projection (:func:`init_long_short_projection`).
      window: sliding window half-width (causal: width back).
      causal: segment-wise causal form; needs ``segment_size``.
      segment_size: tokens per projected segment (causal form only).
      kv_mask: ``bool[L]``, True for real tokens; padding is left out of the projection.
      scale: score scale, ``1/sqrt(Dk)`` by default.

    Returns:
      ``[L, Dv]`` in q's dtype.
    """
    name = "long_short_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    C.check_same_length(name, x, "needs self-attention (Lq == Lk)")
    w_p = jnp.asarray(w_p)
    if w_p.ndim != 2 or w_p.shape[0] != x.dk:
        raise ValueError(f"{name}: w_p must be [Dk, r] with Dk={x.dk} but got {w_p.shape}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"{name}: window must be a non-negative integer but got {window!r}")
    if causal:
        if segment_size is None:
            raise ValueError(f"{name}: causal=True needs segment_size (the segment-wise form)")
        segment = C.check_positive_int(name, "segment_size", segment_size)
    elif segment_size is not None:
        raise ValueError(f"{name}: segment_size is for the causal form only")
    else:
        segment = x.lk
    real = jnp.ones((x.lk,), bool) if kv_mask is None else kv_mask
    local, lse_local = flash_attention(
        x.q, x.k, x.v, pattern=Local(window, 0 if causal else window), causal=causal,
        kv_mask=kv_mask, scale=scale, return_lse=True)
    pk, pv, valid = _project(x.k, x.v, w_p, real, segment)
    r = w_p.shape[1]
    bias = None
    if causal:
        # Slot s belongs to segment s // r; query i may use it once that segment has ended.
        bias = lambda i, j: jnp.where(j // r < i // segment, 0.0, -jnp.inf)
    far, lse_far = flash_attention(x.q.astype(C.STATS_DTYPE), pk, pv, kv_mask=valid, bias=bias,
                                   scale=scale, return_lse=True)
    # One softmax over the union of the two disjoint key sets.
    out, _ = kernels.merge_by_lse(local, lse_local, far, lse_far)
    return out.astype(x.q.dtype)
