"""Talking-heads attention (Shazeer et al., 2020, "Talking-Heads Attention").

Over ``Hk`` query/key heads, ``H`` softmax heads and ``Hv`` value heads::

    J[h]   = sum_hk P_l[hk, h] * scale * q[:, hk] k[:, hk]^T      (mix the logits)
    W[h]   = softmax(J[h])                                          (over the visible keys)
    W'[hv] = sum_h P_w[h, hv] W[h]                                  (mix the weights)
    O[:, hv] = W'[hv] v[:, hv]

``implementation="dense"`` builds the ``[H, Lq, Lk]`` maps. ``"tiled"`` is the same function
on the tiled kernel, never forming a map: the mixed logits of softmax head ``h`` are one dot
product of a mixed query ``[P_l[hk, h] q[:, hk]]_hk`` (width ``Hk Dk``) with the concatenated
keys ``[k[:, hk]]_hk``, and ``W[h] [v[:, 1] ... v[:, Hv]]`` is one attention over the
concatenated values (width ``Hv Dv``), whose per-head slices are mixed by ``P_w`` afterwards.
It does ``H * Hk Dk`` score and ``H * Hv Dv`` value work per key against vanilla's ``H Dk`` and
``H Dv``: an ``Hk``-fold (``Hv``-fold) cost, in O(L) memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _contract as C
from .._exact import flash_attention

IMPLEMENTATIONS = ("dense", "tiled")


def _check(name, q, k, v, logits_mix, weights_mix, kv_mask, implementation):
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    shapes = f"q{q.shape}, k{k.shape}, v{v.shape}"
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"{name}: q, k, v must be [length, heads, dim]; got {shapes} (lift "
                         "over the batch with jax.vmap)")
    if q.shape[1:] != k.shape[1:] or k.shape[0] != v.shape[0]:
        raise ValueError(f"{name}: q and k must share heads and width, k and v their length; "
                         f"got {shapes}")
    hk, hv = q.shape[1], v.shape[1]
    lm, wm = jnp.asarray(logits_mix), jnp.asarray(weights_mix)
    if lm.ndim != 2 or wm.ndim != 2 or lm.shape[0] != hk or wm.shape[1] != hv or \
            lm.shape[1] != wm.shape[0]:
        raise ValueError(f"{name}: logits_mix must be [Hk, H] and weights_mix [H, Hv] with Hk="
                         f"{hk} (q, k heads) and Hv={hv} (v heads); got logits_mix{lm.shape}, "
                         f"weights_mix{wm.shape}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{name}: implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    kv_mask = C.check_kv_mask(name, kv_mask, k.shape[0])
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}: {arg} must be floating point; got {x.dtype}")
    return q, k, v, lm, wm, kv_mask


def talking_heads_attention(q, k, v, logits_mix, weights_mix, *, causal=False, kv_mask=None,
                            segment_ids=None, scale=None, key=None,
                            implementation: str = "tiled",
                            block_q=None, block_k=None):
    """Talking-heads attention over one sequence (all heads at once: heads talk).

    Args:
      q: ``[Lq, Hk, Dk]``. k: ``[Lk, Hk, Dk]``. v: ``[Lk, Hv, Dv]``.
      logits_mix: ``P_l [Hk, H]``; weights_mix: ``P_w [H, Hv]``. Identity matrices give
        vanilla multi-head attention.
      causal, kv_mask (``bool[Lk]``), scale (``1/sqrt(Dk)``), key: the contract.
      segment_ids: packed-sequence ids ``int[L]`` (self-attention): every head's map stays
        inside the query's document (the heads mix per query and key pair, never across
        pairs, so each document gets its own result).
      implementation: ``"tiled"`` (flash, O(L) memory) or ``"dense"`` (the maps).
      block_q, block_k: tiles of the tiled form.

    Returns:
      ``[Lq, Hv, Dv]``.
    """
    name = "talking_heads_attention"
    q, k, v, lm, wm, kv_mask = _check(name, q, k, v, logits_mix, weights_mix, kv_mask,
                                      implementation)
    (lq, hk, dk), (lk, hv, dv) = q.shape, v.shape
    scale = C.resolve_scale(dk, scale)
    if implementation == "dense":
        f32 = jnp.float32
        if kv_mask is not None:
            # Padded keys and values out by a select: a zero weight times NaN padding would
            # still be NaN in the output and in the gradients.
            k, v = (jnp.where(kv_mask[:, None, None], a, jnp.zeros((), a.dtype)) for a in (k, v))
        logits = jnp.einsum("qhd,khd->hqk", q.astype(f32), k.astype(f32)) * scale
        mixed = jnp.einsum("hqk,hg->gqk", logits, lm.astype(f32))
        visible = jnp.ones((lq, lk), bool)
        if causal:
            visible = jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None]
        if kv_mask is not None:
            visible = visible & kv_mask[None, :]
        if segment_ids is not None:
            q_ids, kv_ids = C.check_segment_ids(name, segment_ids, lq, lk)
            visible = visible & (q_ids[:, None] == kv_ids[None, :])
        mixed = jnp.where(visible, mixed, -jnp.inf)
        peak = jnp.max(mixed, axis=-1, keepdims=True)
        e = jnp.where(visible, jnp.exp(mixed - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
        w = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), jnp.finfo(f32).tiny)
        w2 = jnp.einsum("gqk,gv->vqk", w, wm.astype(f32))
        return jnp.einsum("vqk,kvd->qvd", w2, v.astype(f32)).astype(v.dtype)
    qm = q[None] * lm.T.astype(q.dtype)[:, None, :, None]           # [H, Lq, Hk, Dk]
    qm = qm.reshape(lm.shape[1], lq, hk * dk)
    kc, vc = k.reshape(lk, hk * dk), v.reshape(lk, hv * dv)

    def one(qh):
        return flash_attention(qh, kc, vc, causal=causal, kv_mask=kv_mask,
                               segment_ids=segment_ids, scale=scale, block_q=block_q,
                               block_k=block_k)

    o = jax.vmap(one)(qm).reshape(lm.shape[1], lq, hv, dv)         # W[h] v[:, hv]
    return jnp.einsum("hqvd,hv->qvd", o, wm.astype(o.dtype))
