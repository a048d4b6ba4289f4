"""Priors from the layer below (the survey's eq. 22, ``A^l = w1 A^l + w2 g(A^{l-1})``).

* Realformer (He et al., 2021, "RealFormer: Transformer Likes Residual Attention"): the
  pre-softmax scores of layer ``l`` are its own plus the layer below's,
  ``S_l = q_l k_l^T * scale + S_{l-1}`` (:func:`realformer_attention`). Unrolled,
  ``S_l = sum_{m <= l} q_m k_m^T * scale`` is one dot product of the layers' queries and keys
  concatenated along the feature axis, so the same function runs on the tiled kernel
  (:func:`realformer_flash_attention`) with no score matrix carried between layers.
* Predictive attention (Wang et al., 2021, "Predictive Attention Transformer: Improving
  Transformer with Attention Map Prediction"): ``S_l = alpha * q_l k_l^T * scale +
  (1 - alpha) * Conv(S_{l-1})``, a 3 x 3 convolution over the previous layer's score maps with
  the heads as channels (:func:`predictive_attention`). It needs the map itself: a dense-score
  kind.
* Lazyformer (Ying et al., 2021, "LazyFormer: Self Attention with Lazy Update"): the attention
  weights are computed once every ``k`` layers and reused by the layers in between, which only
  apply them to their own values (:func:`lazy_attention`). Also a dense-score kind.

The dense functions return ``(out, scores)`` so a stack can hand the scores to the next layer.

Packed rows (``segment_ids int[L]``): each layer's softmax sees the query's own document; the
carried scores or weights of the other documents' entries are never read (Realformer and
Lazyformer read only visible entries; Predictive attention's convolution reads zeros past a
document's edges, as the zero padding of the document alone gives: ``predictive_conv``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._exact import flash_attention


def _visible(lq, lk, causal, kv_mask, segment_ids=None, name="attention_weights"):
    vis = jnp.ones((lq, lk), bool)
    if causal:
        vis = jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None]
    if kv_mask is not None:
        vis = vis & kv_mask[None, :]
    segs = C.check_segment_ids(name, segment_ids, lq, lk)
    if segs is not None:
        vis = vis & (segs[0][:, None] == segs[1][None, :])
    return vis


def _softmax(scores, vis):
    s = jnp.where(vis, scores, -jnp.inf)
    peak = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(vis, jnp.exp(s - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
    return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)


def attention_weights(q, k, *, causal=False, kv_mask=None, segment_ids=None, scale=None,
                      prior=None):
    """``softmax(q k^T * scale + prior)`` over the visible keys (with ``segment_ids``, those
    of the query's document), float32 ``[Lq, Lk]`` (a query that sees no key gets a zero
    row). Also returns the pre-mask scores: ``(weights, scores)``."""
    q, k = jnp.asarray(q), jnp.asarray(k)
    scale = C.resolve_scale(q.shape[-1], scale)
    scores = (q.astype(jnp.float32) @ k.astype(jnp.float32).T) * scale
    if prior is not None:
        scores = scores + prior
    return _softmax(scores, _visible(q.shape[0], k.shape[0], causal, kv_mask,
                                     segment_ids)), scores


def realformer_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    prev_scores=None,
    *,
    causal=False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale=None,
    key=None,
):
    """One Realformer layer, dense: ``(softmax(S) v, S)`` with
    ``S = q k^T * scale + prev_scores``.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      prev_scores: ``[Lq, Lk]``, the layer below's ``S`` (None for the first layer).
      causal, kv_mask, scale, key: the contract (masks apply to this layer's softmax; ``S``
        is carried unmasked, as in the paper). segment_ids: packed-sequence ids.

    Returns:
      ``(out [Lq, Dv], scores [Lq, Lk] float32)``.
    """
    name = "realformer_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    if prev_scores is not None and jnp.shape(prev_scores) != (x.lq, x.lk):
        raise ValueError(f"{name}: prev_scores must be [Lq, Lk] = [{x.lq}, {x.lk}] but got "
                         f"{jnp.shape(prev_scores)}")
    w, s = attention_weights(x.q, x.k, causal=causal, kv_mask=kv_mask,
                             segment_ids=segment_ids, scale=scale, prior=prev_scores)
    return (w @ x.v.astype(jnp.float32)).astype(x.v.dtype), s


def realformer_flash_attention(qs, ks, v, *, causal=False, kv_mask=None, segment_ids=None,
                               scale=None, key=None, block_q=None, block_k=None):
    """Layer ``n`` of a Realformer stack on the tiled kernel, exact: ``softmax(sum_m q_m k_m^T
    * scale) v`` as one attention over the concatenated ``[q_1 ... q_n]`` and
    ``[k_1 ... k_n]`` (width ``n Dk``). O(L) memory; the score work grows as ``n``.

    Args:
      qs: ``[n, Lq, Dk]``, this layer's and every layer below's queries (oldest first).
      ks: ``[n, Lk, Dk]``, their keys. v: ``[Lk, Dv]``, this layer's values.
      causal, kv_mask, segment_ids, scale, key, block_q, block_k: as
        :func:`~xformers_jax.attention.flash_attention` (``scale`` ``1/sqrt(Dk)``, per layer).

    Returns:
      ``[Lq, Dv]``, equal to the last layer's output of a chain of
      :func:`realformer_attention`.
    """
    name = "realformer_flash_attention"
    qs, ks = jnp.asarray(qs), jnp.asarray(ks)
    if qs.ndim != 3 or ks.ndim != 3 or qs.shape[0] != ks.shape[0] or qs.shape[2] != ks.shape[2]:
        raise ValueError(f"{name}: qs [n, Lq, Dk] and ks [n, Lk, Dk] with one n expected; got "
                         f"qs{qs.shape}, ks{ks.shape}")
    n, lq, dk = qs.shape
    x, kv_mask = C.check_qkv_mask(name, qs[0], ks[0], v, kv_mask)
    scale = C.resolve_scale(dk, scale)
    qc = jnp.moveaxis(qs, 0, 1).reshape(lq, n * dk)
    kc = jnp.moveaxis(ks, 0, 1).reshape(x.lk, n * dk)
    return flash_attention(qc, kc, x.v, causal=causal, kv_mask=kv_mask,
                           segment_ids=segment_ids, scale=scale, block_q=block_q,
                           block_k=block_k)


def init_predictive_conv(key, num_heads: int, dtype=jnp.float32):
    """A 3 x 3 convolution over ``H`` score maps: ``[H_out, H_in, 3, 3]``, near the identity
    (centre tap 1 on the diagonal) plus small noise."""
    eye = jnp.zeros((num_heads, num_heads, 3, 3), dtype).at[
        jnp.arange(num_heads), jnp.arange(num_heads), 1, 1].set(1.0)
    return eye + 0.01 * jax.random.normal(key, eye.shape, dtype)


def predictive_conv(prev_scores, conv, *, causal=False, kv_mask=None, segment_ids=None):
    """``Conv(S_{l-1})``: ``prev_scores [H, L, L]`` convolved with ``conv [H, H, 3, 3]`` (zero
    padding). Entries no query may see (future keys when causal, padded keys or queries) are
    zeroed first, and a causal map is convolved with taps on the rows at and above the query
    (rows ``i-2 .. i``), so row ``i`` reads no later position.

    With packed-sequence ids ``segment_ids int[L]`` each document's map is convolved as if
    alone: the entries between documents are zeroed, and a tap on a row of another document
    reads zero (its entry may be visible to that document: the diagonal corner where two
    documents meet), so every tap outside the document reads what the zero padding of the
    document alone gives."""
    h, lq, lk = prev_scores.shape
    vis = _visible(lq, lk, causal, kv_mask, segment_ids, "predictive_conv")
    if kv_mask is not None and lq == lk:
        vis = vis & kv_mask[:, None]
    s = jnp.where(vis, prev_scores.astype(jnp.float32), 0.0)
    conv = conv.astype(jnp.float32)
    top = 2 if causal else 1
    if segment_ids is None:
        out = jax.lax.conv_general_dilated(s[None], conv, (1, 1), ((top, 2 - top), (1, 1)),
                                           dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return out[0]
    # One row offset of the taps at a time: rows of another document out, then the 1 x 3
    # taps along the keys.
    seg = C.check_segment_ids("predictive_conv", segment_ids, lq, lk)[0]
    rows = jnp.arange(lq)
    out = jnp.zeros((h, lq, lk), jnp.float32)
    for a in range(3):
        src = rows + a - top
        same = (src >= 0) & (src < lq) & (seg[jnp.clip(src, 0, lq - 1)] == seg)
        shifted = jnp.where(same[None, :, None], s[:, jnp.clip(src, 0, lq - 1)], 0.0)
        out = out + jax.lax.conv_general_dilated(
            shifted[None], conv[:, :, a:a + 1], (1, 1), ((0, 0), (1, 1)),
            dimension_numbers=("NCHW", "OIHW", "NCHW"))[0]
    return out


def predictive_attention(q, k, v, prev_scores, conv, alpha, *, causal=False, kv_mask=None,
                         segment_ids=None, scale=None, key=None):
    """One Predictive-attention layer over all heads of one sequence.

    ``S = alpha * q k^T * scale + (1 - alpha) * Conv(prev_scores)`` per head, then
    ``softmax(S) v``; ``prev_scores=None`` (the first layer) gives vanilla attention.

    Args:
      q: ``[L, H, Dk]``. k: ``[L, H, Dk]``. v: ``[L, H, Dv]``.
      prev_scores: ``[H, L, L]`` or None. conv: ``[H, H, 3, 3]``. alpha: scalar in [0, 1].
      causal, kv_mask (``bool[L]``), scale, key: the contract. segment_ids: packed-sequence
        ids ``int[L]``.

    Returns:
      ``(out [L, H, Dv], scores [H, L, L] float32)``.
    """
    name = "predictive_attention"
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if q.ndim != 3 or q.shape != k.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"{name}: q, k [L, H, Dk] and v [L, H, Dv] expected (self-attention); "
                         f"got q{q.shape}, k{k.shape}, v{v.shape}")
    lq, h, dk = q.shape
    if jnp.shape(conv) != (h, h, 3, 3):
        raise ValueError(f"{name}: conv must be [H, H, 3, 3] = [{h}, {h}, 3, 3]; got "
                         f"{jnp.shape(conv)}")
    if prev_scores is not None and jnp.shape(prev_scores) != (h, lq, lq):
        raise ValueError(f"{name}: prev_scores must be [H, L, L] = [{h}, {lq}, {lq}]; got "
                         f"{jnp.shape(prev_scores)}")
    kv_mask = C.check_kv_mask(name, kv_mask, lq)
    if kv_mask is not None:  # padded keys and values out (0 * nan is NaN), as check_qkv_mask
        k, v = (jnp.where(kv_mask[:, None, None], a, jnp.zeros((), a.dtype)) for a in (k, v))
    scale = C.resolve_scale(dk, scale)
    own = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    s = own if prev_scores is None else alpha * own + (1 - alpha) * predictive_conv(
        prev_scores, conv, causal=causal, kv_mask=kv_mask, segment_ids=segment_ids)
    w = _softmax(s, _visible(lq, lq, causal, kv_mask, segment_ids, name)[None])
    return jnp.einsum("hqk,khd->qhd", w, v.astype(jnp.float32)).astype(v.dtype), s


def lazy_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    prev_weights=None,
    *,
    recompute: bool = True,
    causal=False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale=None,
    key=None,
):
    """One Lazyformer layer: ``(W v, W)`` with ``W = softmax(q k^T * scale)`` when
    ``recompute`` (every ``k``-th layer) and ``W = prev_weights`` otherwise. With ``k = 1``
    every layer recomputes: vanilla attention.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      prev_weights: ``[Lq, Lk]`` from the last recomputing layer (needed when not
        ``recompute``).
      segment_ids: packed-sequence ids: a recomputed map stays inside each document (a reused
        one already does).

    Returns:
      ``(out [Lq, Dv], weights [Lq, Lk] float32)``.
    """
    name = "lazy_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    if recompute:
        w, _ = attention_weights(x.q, x.k, causal=causal, kv_mask=kv_mask,
                                 segment_ids=segment_ids, scale=scale)
    else:
        if prev_weights is None or jnp.shape(prev_weights) != (x.lq, x.lk):
            raise ValueError(f"{name}: a layer that reuses the map needs prev_weights [Lq, Lk] "
                             f"= [{x.lq}, {x.lk}]; got "
                             f"{None if prev_weights is None else jnp.shape(prev_weights)}")
        w = jnp.asarray(prev_weights, jnp.float32)
    return (w @ x.v.astype(jnp.float32)).astype(x.v.dtype), w
