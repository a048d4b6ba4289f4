"""Scaled dot-product attention, computed densely: the reference every variant is tested against.

Vaswani et al., 2017, "Attention Is All You Need".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from . import _contract as C
from .. import kernels
from .patterns import Causal, Pattern


def combined_pattern(name: str, pattern: Pattern | None, causal: bool) -> Pattern | None:
    """The static pattern a call asks for: ``pattern``, intersected with Causal if causal."""
    if pattern is not None and not isinstance(pattern, Pattern):
        raise ValueError(
            f"{name}: pattern must be an xformers_jax.attention.patterns.Pattern, got "
            f"{type(pattern).__name__}"
        )
    if causal and pattern is not None and pattern.encoder_only:
        C.causal_unsupported(
            name, f"{pattern!r} is an encoder-only pattern (its global, random or permuted "
            "connections are defined over the whole sequence, so it cannot decode)"
        )
    if causal:
        return Causal() if pattern is None else pattern & Causal()
    return pattern


def dot_product_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    bias=None,
    pattern: Pattern | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    key=None,
    return_weights: bool = False,
) -> (Float[Array, "q_seq v_dim"]
      | tuple[Float[Array, "q_seq v_dim"], Float[Array, "q_seq kv_seq"]]):
    """Dense softmax attention for one sequence and one head.

    ``softmax(q k^T * scale + bias, masked) v``, with the full ``[Lq, Lk]`` score matrix in
    memory. Masked positions get exactly zero weight; a query that sees no key gets a zero
    output and zero (finite) gradients.

    Args:
      q: ``[Lq, Dk]`` queries.
      k: ``[Lk, Dk]`` keys.
      v: ``[Lk, Dv]`` values.
      causal: query i sees keys ``j <= i`` only.
      kv_mask: ``bool[Lk]``, True for real keys.
      segment_ids: ``int[L]`` or a pair ``(int[Lq], int[Lk])``: packed sequences; queries see
        only keys with the same id.
      bias: additive score bias, an array ``[Lq, Lk]`` or a callable
        ``bias(q_positions [Lq, 1], k_positions [1, Lk]) -> [Lq, Lk]``.
      pattern: a static :class:`~xformers_jax.attention.patterns.Pattern` (e.g. ``Local``).
      scale: score scale; ``1/sqrt(Dk)`` by default.
      dropout_rate: attention dropout on the normalised weights (needs ``key``).
      key: PRNG key for dropout.
      return_weights: also return the ``[Lq, Lk]`` weights applied to ``v``.

    Returns:
      ``[Lq, Dv]`` in q's dtype, or ``(out, weights)`` with float32 weights.
    """
    name = "dot_product_attention"
    x, kv_mask, segs, bias, scale = C.check_softmax_args(
        name, q, k, v, kv_mask, segment_ids, bias, dropout_rate, key, scale)
    pattern = combined_pattern(name, pattern, causal)

    s = jnp.einsum("qd,kd->qk", x.q, x.k, preferred_element_type=C.STATS_DTYPE) * scale
    return attend_logits(s, x.v, kv_mask=kv_mask, segment_ids=segs, bias=bias, pattern=pattern,
                         dropout_rate=dropout_rate, key=key, return_weights=return_weights,
                         out_dtype=x.q.dtype)


def attend_logits(s, v, *, kv_mask=None, segment_ids=None, bias=None, pattern=None,
                  dropout_rate: float = 0.0, key=None, return_weights: bool = False,
                  out_dtype=None):
    """The softmax-and-values half of :func:`dot_product_attention`, from float32 logits.

    For variants whose logits are not ``q k^T`` (e.g. Synthesizer's synthetic logits), so
    they share the masking, the guarded normalisation and dropout without paying for a
    product they do not use. Arguments are already checked: ``s [Lq, Lk]`` float32, ``v [Lk,
    Dv]``, ``kv_mask``, ``segment_ids`` as a (q, kv) pair or None, ``bias`` an array or
    callable, ``pattern`` a Pattern (causality folded in) or None.
    """
    lq, lk = s.shape
    q_pos = jnp.arange(lq, dtype=jnp.int32)[:, None]
    k_pos = jnp.arange(lk, dtype=jnp.int32)[None, :]
    if bias is not None:
        s = s + (bias(q_pos, k_pos) if callable(bias) else bias).astype(C.STATS_DTYPE)
    mask = kernels.dynamic_mask(kv_mask, *(segment_ids or (None, None)))
    if pattern is not None:
        mask = kernels.and_masks(mask, jnp.asarray(pattern.dense(lq, lk)))
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    m = jax.lax.stop_gradient(kernels.safe_max(jnp.max(s, axis=-1)))
    p = jnp.exp(s - m[:, None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    weights = p / jnp.where(p.sum(-1) == 0, 1.0, p.sum(-1))[:, None]
    if dropout_rate > 0.0:
        keep = kernels.dropout_keep(kernels.dropout_seed(key), q_pos, k_pos, dropout_rate)
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum(
        "qk,kd->qd", weights.astype(v.dtype), v, preferred_element_type=C.STATS_DTYPE
    ).astype(out_dtype or v.dtype)
    return (out, weights) if return_weights else out


def _short_fwd_math(q, k, v, kv_mask, scale):
    s = jnp.einsum("qd,kd->qk", q, k, preferred_element_type=C.STATS_DTYPE) * scale
    if kv_mask is not None:
        s = jnp.where(kv_mask[None, :], s, -jnp.inf)
    m = kernels.safe_max(jnp.max(s, axis=-1))
    e = jnp.exp(s - m[:, None])  # exactly 0 at masked keys
    den = e.sum(-1)
    den = jnp.where(den == 0, 1.0, den)  # a query that sees no key gets zeros
    out = jnp.einsum("qk,kd->qd", e.astype(v.dtype), v, preferred_element_type=C.STATS_DTYPE)
    return out / den[:, None], (e, den)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _short_attention(q, k, v, kv_mask, scale):
    return _short_fwd_math(q, k, v, kv_mask, scale)[0].astype(q.dtype)


def _short_attention_fwd(q, k, v, kv_mask, scale):
    out, (e, den) = _short_fwd_math(q, k, v, kv_mask, scale)
    return out.astype(q.dtype), (q, k, v, e, den, out)


def _short_attention_bwd(scale, res, g):
    q, k, v, e, den, out = res
    f32 = C.STATS_DTYPE
    g = g.astype(f32)
    w = e / den[:, None]
    dv = jnp.einsum("qk,qd->kd", w, g)
    dw = jnp.einsum("qd,kd->qk", g, v.astype(f32))
    # rowsum(dW * W) = rowsum(dO * O): the softmax backward's row sums over the short
    # [Lq, Dv] side instead of the [Lq, Lk] weights.
    ds = w * (dw - jnp.sum(g * out, -1)[:, None]) * scale
    dq = jnp.einsum("qk,kd->qd", ds, k.astype(f32))
    dk = jnp.einsum("qk,qd->kd", ds, q.astype(f32))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_short_attention.defvjp(_short_attention_fwd, _short_attention_bwd)


def short_softmax_attention(q, k, v, *, kv_mask=None, scale):
    """``softmax(q k^T * scale, masked) v`` with a hand-written backward pass.

    The same function as :func:`dot_product_attention` with only ``kv_mask`` (to rounding:
    the normalisation is applied after the value matmul), for variants whose queries or keys
    are a short set (Linformer's projected slots, Luna's pack and unpack). Its backward
    forms the softmax derivative's row sums from ``dO * O`` (``[Lq, Dv]``) rather than
    ``dW * W`` (``[Lq, Lk]``), which XLA's CPU backend otherwise runs as a slow reduction.
    It keeps the ``[Lq, Lk]`` weights for the backward, as autodiff would. Arguments are
    already checked. A ``scale`` that is not a static number (traced, e.g. learned) takes
    :func:`dot_product_attention`, which differentiates it too.
    """
    if not isinstance(scale, (int, float, np.integer, np.floating)):
        return dot_product_attention(q, k, v, kv_mask=kv_mask, scale=scale)
    return _short_attention(q, k, v, kv_mask, float(scale))
