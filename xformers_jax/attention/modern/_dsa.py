"""DeepSeek sparse attention (DeepSeek-AI, 2025, "DeepSeek-V3.2-Exp: Boosting Long-Context
Efficiency with DeepSeek Sparse Attention", Section 2.1, Eqs. 1-2).

A lightning indexer scores every preceding token ``s`` for query token ``t`` with a few small
heads,

    I_{t,s} = sum_j w_{t,j} ReLU(q^I_{t,j} . k^I_s)           (Eq. 1)

(``q^I``, ``w`` from token ``t``, ``k^I`` from token ``s``, one indexer key shared by the
indexer heads), and the main attention of token ``t`` runs over the ``top_k`` tokens with the
largest ``I_{t,s}`` only (Eq. 2): one choice per token, shared by every attention head.

Fast form: the indexer is computed ``chunk`` queries at a time (``[chunk, Lk]`` scores, never
``[Lq, Lk]``: it is the one ``O(L^2)`` part, with ``H_I d_I`` multiply-adds per pair), and the
chosen keys and values are gathered per query (``top_k`` of them) for the softmax. The choice
is a discrete top-k, so no gradient reaches the indexer through it: the paper trains the
indexer with its own loss (the KL divergence to the main attention's distribution), which this
function does not form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ...kernels import STATS_DTYPE, cdiv, pad_to
from .. import _contract as C
from ._moba import gathered_block_attention


def lightning_indexer(
    q_index: Float[Array, "q_seq index_heads index_dim"],
    weights: Float[Array, "q_seq index_heads"],
    k_index: Float[Array, "kv_seq index_dim"],
    *,
    top_k: int,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    q_offset=0,
    chunk: int = 256,
) -> tuple[Int[Array, "q_seq top_k"], Bool[Array, "q_seq top_k"]]:
    """The tokens each query chooses by the lightning indexer (DeepSeek-V3.2, Eq. 1).

    Args:
      q_index: ``[Lq, H_I, d_I]`` indexer queries. weights: ``[Lq, H_I]`` their per-head
        weights ``w``. k_index: ``[Lk, d_I]`` indexer keys.
      top_k: tokens per query. causal: only keys at or before the query's position
        (``q_offset + i``; ``q_offset`` may be traced). kv_mask: ``bool[Lk]``, real keys.
      chunk: queries scored at a time.

    Returns:
      ``(index int32[Lq, n], chosen bool[Lq, n])``, ``n = min(top_k, Lk)``; a slot is not
      ``chosen`` when fewer keys qualify. Ties go to the earlier key.
    """
    lq, h, d = q_index.shape
    lk = k_index.shape[0]
    if weights.shape != (lq, h) or k_index.shape[1] != d:
        raise ValueError(f"lightning_indexer: expected q_index [Lq, H_I, d_I], weights "
                         f"[Lq, H_I], k_index [Lk, d_I]; got q_index{tuple(q_index.shape)}, "
                         f"weights{tuple(weights.shape)}, k_index{tuple(k_index.shape)}")
    n = min(C.check_positive_int("lightning_indexer", "top_k", top_k), lk)
    real = jnp.ones((lk,), bool) if kv_mask is None else kv_mask
    kf = jnp.where(real[:, None], k_index, 0).astype(STATS_DTYPE)
    cq = min(chunk, lq)
    nc = cdiv(lq, cq)
    qs = pad_to(q_index.astype(STATS_DTYPE), nc * cq).reshape(nc, cq, h, d)
    ws = pad_to(weights.astype(STATS_DTYPE), nc * cq).reshape(nc, cq, h)
    pos = (q_offset + jnp.arange(nc * cq)).reshape(nc, cq)
    k_pos = jnp.arange(lk)

    def one(args):
        qc, wc, pc = args
        score = jnp.einsum("qh,qhk->qk", wc, jax.nn.relu(jnp.einsum("qhd,kd->qhk", qc, kf)))
        ok = jnp.broadcast_to(real, score.shape)
        if causal:
            ok = ok & (k_pos[None, :] <= pc[:, None])
        val, idx = jax.lax.top_k(jnp.where(ok, score, -jnp.inf), n)
        return idx.astype(jnp.int32), jnp.isfinite(val)

    idx, chosen = jax.lax.map(one, (jax.lax.stop_gradient(qs), jax.lax.stop_gradient(ws), pos))
    return idx.reshape(nc * cq, n)[:lq], chosen.reshape(nc * cq, n)[:lq]


def deepseek_sparse_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    index: Int[Array, "q_seq top_k"],
    chosen: Bool[Array, "q_seq top_k"],
    *,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    key=None,
    chunk: int = 256,
) -> Float[Array, "q_seq v_dim"]:
    """DeepSeek sparse attention of one head (DeepSeek-V3.2, Eq. 2): softmax attention of each
    query over only the keys ``index [Lq, n]`` (``chosen`` marks the real choices) that
    :func:`lightning_indexer` picked, gathered ``chunk`` queries at a time.

    Args:
      q: ``[Lq, D]``. k: ``[Lk, D]``. v: ``[Lk, Dv]``. index, chosen: the indexer's choice,
        shared by the heads. causal: the choice must then hold no later key (the indexer's
        ``causal``); the keys are not masked again. kv_mask, key: the contract's.
      scale: ``1/sqrt(D)`` by default.

    Returns:
      ``[Lq, Dv]`` in q's dtype; a query with no chosen key gives zeros.
    """
    name = "deepseek_sparse_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    if index.shape != chosen.shape or index.ndim != 2 or index.shape[0] != x.lq:
        raise ValueError(f"{name}: index and chosen must be [Lq, n] with Lq = {x.lq}; got "
                         f"index{tuple(index.shape)}, chosen{tuple(chosen.shape)}")
    scale = C.resolve_scale(x.dk, scale)
    out, _ = gathered_block_attention(x.q, x.k, x.v, index, chosen, block_size=1,
                                      kv_mask=kv_mask, scale=scale, chunk=chunk)
    return out.astype(q.dtype)


def deepseek_sparse_reference(q, k, v, q_index, weights, k_index, *, top_k: int,
                              causal: bool = False, kv_mask=None, scale=None, q_offset=0):
    """DeepSeek sparse attention from the equations, densely (float32): the ``[Lq, Lk]``
    indexer scores, their top ``top_k`` keys as a mask, one masked softmax (for tests and one
    decoding step; queries at ``q_offset + arange(Lq)``)."""
    x, kv_mask = C.check_qkv_mask("deepseek_sparse_reference", q, k, v, kv_mask)
    scale = C.resolve_scale(x.dk, scale)

    def f(a):
        return jnp.asarray(a, STATS_DTYPE)

    real = jnp.ones((x.lk,), bool) if kv_mask is None else kv_mask
    k_index = jnp.where(real[:, None], f(k_index), 0.0)
    score = jnp.einsum("qh,qhk->qk", f(weights),
                       jax.nn.relu(jnp.einsum("qhd,kd->qhk", f(q_index), k_index)))
    k_pos, q_pos = jnp.arange(x.lk), q_offset + jnp.arange(x.lq)
    ok = jnp.broadcast_to(real, score.shape)
    if causal:
        ok = ok & (k_pos[None, :] <= q_pos[:, None])
    val, idx = jax.lax.top_k(jnp.where(ok, score, -jnp.inf), min(top_k, x.lk))
    keep = jnp.zeros((x.lq, x.lk), bool).at[jnp.arange(x.lq)[:, None], idx].max(
        jnp.isfinite(val))
    s = jnp.where(keep, f(x.q) @ f(x.k).T * scale, -jnp.inf)
    p = jnp.where(keep, jnp.exp(s - jnp.max(jnp.where(keep, s, -1e30), -1, keepdims=True)), 0.0)
    out = p @ f(x.v) / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return out.astype(q.dtype)
