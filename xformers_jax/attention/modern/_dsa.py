"""DeepSeek sparse attention (DeepSeek-AI, 2025, "DeepSeek-V3.2-Exp: Boosting Long-Context
Efficiency with DeepSeek Sparse Attention", Section 2.1, Eqs. 1-2).

A lightning indexer scores every preceding token ``s`` for query token ``t`` with a few small
heads,

    I_{t,s} = sum_j w_{t,j} ReLU(q^I_{t,j} . k^I_s)           (Eq. 1)

(``q^I``, ``w`` from token ``t``, ``k^I`` from token ``s``, one indexer key shared by the
indexer heads), and the main attention of token ``t`` runs over the ``top_k`` tokens with the
largest ``I_{t,s}`` only (Eq. 2): one choice per token, shared by every attention head.

Fast forms: the indexer is computed ``chunk`` queries at a time (``[chunk, Lk]`` scores, never
``[Lq, Lk]``, with ``H_I d_I`` multiply-adds per pair). The attention either gathers each
query's ``top_k`` chosen keys and values (:func:`deepseek_sparse_attention`, what a decoding
step does) or reads the choice as a bit mask on the tiled kernel (:func:`deepseek_sparse_tiled`,
what the ``dsa`` kind's layer runs: on XLA:CPU the gathers, and the scatter-adds of their
backward pass, cost more than the arithmetic they save; see its docstring). The choice
is a discrete top-k, so no gradient reaches the indexer through it: the paper trains the
indexer with its own loss, the KL divergence from the main attention's distribution (summed
over heads, L1-normalised) to the indexer's softmax, over every key in a dense warm-up and
over the selected tokens afterwards (Section 2.1.1): :func:`indexer_alignment_loss`, which the
``dsa`` kind's layer reports as its auxiliary loss ``indexer_kl``.

Speed on a CPU: the indexer's cost is its top-k, not its scores. At 16384 tokens (4 indexer
heads of 32, top 2048, causal), XLA:CPU's top-k over each query's keys took about as long as
causal flash attention's forward and backward with one key/value head, and the scores under a
fifth of that; so no form of the attention makes DSA faster than causal flash there (the
``modern_attention`` suite's (why) row measures it). The paper's indexer is larger (more and
wider heads) and runs in FP8 on accelerators.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, UInt32

from ...kernels import STATS_DTYPE, cdiv, pad_to, safe_max
from .. import _contract as C
from .._flex import flex_attention
from ._moba import gathered_block_attention


def lightning_indexer(
    q_index: Float[Array, "q_seq index_heads index_dim"],
    weights: Float[Array, "q_seq index_heads"],
    k_index: Float[Array, "kv_seq index_dim"],
    *,
    top_k: int,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    q_offset=0,
    chunk: int = 256,
    return_bits: bool = False,
):
    """The tokens each query chooses by the lightning indexer (DeepSeek-V3.2, Eq. 1).

    Args:
      q_index: ``[Lq, H_I, d_I]`` indexer queries. weights: ``[Lq, H_I]`` their per-head
        weights ``w``. k_index: ``[Lk, d_I]`` indexer keys.
      top_k: tokens per query. causal: only keys at or before the query's position
        (``q_offset + i``; ``q_offset`` may be traced). kv_mask: ``bool[Lk]``, real keys.
      segment_ids: packed-sequence ids ``int[L]`` or a ``(q, kv)`` pair: a query chooses
        among its own document's keys only (the scores are per pair of tokens, so each
        document's choice is the one it makes alone).
      chunk: queries scored at a time.
      return_bits: also return the choice as a bit mask (for
        :func:`deepseek_sparse_tiled`).

    Returns:
      ``(index int32[Lq, n], chosen bool[Lq, n])``, ``n = min(top_k, Lk)``; a slot is not
      ``chosen`` when fewer keys qualify. Ties go to the earlier key. With ``return_bits``
      also ``bits uint32[Lq, ceil(Lk / 32)]``: key ``s`` is chosen by query ``t`` when bit
      ``s % 32`` of ``bits[t, s // 32]`` is set (the same choice, read off the scores by the
      ``top_k``-th largest one and the last tied key taken; ``Lq Lk / 8`` bytes, fewer than
      the index's ``4 Lq n`` once ``n > Lk / 32``).
    """
    lq, h, d = q_index.shape
    lk = k_index.shape[0]
    if weights.shape != (lq, h) or k_index.shape[1] != d:
        raise ValueError(f"lightning_indexer: expected q_index [Lq, H_I, d_I], weights "
                         f"[Lq, H_I], k_index [Lk, d_I]; got q_index{tuple(q_index.shape)}, "
                         f"weights{tuple(weights.shape)}, k_index{tuple(k_index.shape)}")
    n = min(C.check_positive_int("lightning_indexer", "top_k", top_k), lk)
    real = jnp.ones((lk,), bool) if kv_mask is None else kv_mask
    segs = C.check_segment_ids("lightning_indexer", segment_ids, lq, lk)
    kf = jnp.where(real[:, None], k_index, 0).astype(STATS_DTYPE)
    cq = min(chunk, lq)
    nc = cdiv(lq, cq)
    qs = pad_to(q_index.astype(STATS_DTYPE), nc * cq).reshape(nc, cq, h, d)
    ws = pad_to(weights.astype(STATS_DTYPE), nc * cq).reshape(nc, cq, h)
    pos = (q_offset + jnp.arange(nc * cq)).reshape(nc, cq)
    k_pos = jnp.arange(lk)

    def one(args, width):
        qc, wc, pc = args[:3]
        kw, kp = kf[:width], k_pos[:width]
        score = jnp.einsum("qh,qhk->qk", wc, jax.nn.relu(jnp.einsum("qhd,kd->qhk", qc, kw)))
        ok = jnp.broadcast_to(real[:width], score.shape)
        if causal:
            ok = ok & (kp[None, :] <= pc[:, None])
        if segs is not None:
            ok = ok & (args[3][:, None] == segs[1][None, :width])
        val, idx = jax.lax.top_k(jnp.where(ok, score, -jnp.inf), min(n, width))
        val = pad_to(val, n, axis=1, value=-jnp.inf)
        idx = pad_to(idx.astype(jnp.int32), n, axis=1)
        if not return_bits:
            return idx, jnp.isfinite(val)
        # The same choice as a mask: the scores above the n-th largest, and of those equal to
        # it the keys up to the last one top_k took (it takes tied keys earliest first).
        # (val is sorted: its minimum is its last entry, but XLA:CPU runs the top_k as a full
        # sort, measured 5x slower, when the last column is sliced out.)
        tau = val.min(-1, keepdims=True)
        last_tie = jnp.max(jnp.where(val == tau, idx, -1), -1, keepdims=True)
        sel = ok & ((score > tau) | ((score == tau) & (kp[None, :] <= last_tie)))
        words = pad_to(sel, nw * 32, axis=1, value=False).reshape(cq, nw, 32)
        bits = jnp.sum(jnp.where(words, jnp.left_shift(jnp.uint32(1), _BIT), jnp.uint32(0)),
                       -1, dtype=jnp.uint32)
        return idx, jnp.isfinite(val), bits

    nw = cdiv(lk, 32)
    xs = (jax.lax.stop_gradient(qs), jax.lax.stop_gradient(ws), pos)
    if segs is not None:
        xs += (pad_to(segs[0], nc * cq).reshape(nc, cq),)
    if causal and isinstance(q_offset, int):
        # The queries of later chunks see more keys: the chunks run in a few segments, each
        # scoring only the keys its last query sees (causal self-attention: about half the
        # scores and of the top_k's input, its largest cost).
        nseg = min(_SEGMENTS, nc)
        bounds = [round(i * nc / nseg) for i in range(nseg + 1)]
        parts = [jax.lax.map(functools.partial(one, width=min(lk, max(q_offset + c1 * cq, 1))),
                             tuple(a[c0:c1] for a in xs))
                 for c0, c1 in zip(bounds[:-1], bounds[1:])]
        out = tuple(jnp.concatenate(p, 0) for p in zip(*parts))
    else:
        out = jax.lax.map(functools.partial(one, width=lk), xs)
    return tuple(a.reshape(nc * cq, *a.shape[2:])[:lq] for a in out)


_SEGMENTS = 8
_BIT = np.arange(32, dtype=np.uint32)


def _chosen_bit(bits):
    """``mask_mod`` reading a :func:`lightning_indexer` bit mask ``uint32[Lq, Lk / 32]``."""
    def chosen(b, h, q_idx, kv_idx):
        word = bits[q_idx, kv_idx >> 5]
        return (jnp.right_shift(word, (kv_idx & 31).astype(jnp.uint32)) & 1) == 1
    return chosen


def deepseek_sparse_tiled(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    bits: UInt32[Array, "q_seq kv_words"],
    *,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale: float | None = None,
    key=None,
    block_q: int | None = None,
    block_k: int | None = None,
    implementation: str | None = None,
) -> Float[Array, "q_seq v_dim"]:
    """DeepSeek sparse attention of one head (DeepSeek-V3.2, Eq. 2) on the tiled kernel: the
    indexer's choice as a mask function (``bits`` from ``lightning_indexer(...,
    return_bits=True)``) of :func:`~xformers_jax.attention.flex_attention`. Equal to
    :func:`deepseek_sparse_attention` with the same choice.

    Why both forms: gathering each query's ``top_k`` keys and values (``2 top_k D`` numbers per
    query, scatter-added back in the backward pass) computes only the chosen pairs, but on
    XLA:CPU the per-row gathers and scatters cost more than the arithmetic they save (measured
    at 4096 tokens, 1/8 chosen, fwd+bwd: twice causal flash's time). A token-level choice
    leaves no tile empty, so this form does causal flash's arithmetic plus one bit per pair:
    about flash's time, whatever ``top_k``. Decoding (one query) gathers.

    Args:
      q: ``[Lq, D]``. k: ``[Lk, D]``. v: ``[Lk, Dv]``. bits: ``uint32[Lq, ceil(Lk / 32)]``.
      causal: skip the tiles above the diagonal (the choice holds no later key).
      kv_mask, key: the contract's. segment_ids: packed-sequence ids (a choice made with
        them holds no other document's key; here they let the kernel skip the tiles between
        documents). scale: ``1/sqrt(D)`` by default. block_q, block_k, implementation: the
        tiled kernel's.

    Returns:
      ``[Lq, Dv]`` in q's dtype; a query with no chosen key gives zeros.
    """
    lq, lk = q.shape[0], k.shape[0]
    if bits.shape != (lq, cdiv(lk, 32)) or bits.dtype != jnp.uint32:
        raise ValueError(f"deepseek_sparse_tiled: bits must be uint32[Lq, ceil(Lk / 32)] = "
                         f"[{lq}, {cdiv(lk, 32)}]; got {bits.dtype}{tuple(bits.shape)}")
    return flex_attention(q, k, v, mask_mod=_chosen_bit(bits), causal=causal, kv_mask=kv_mask,
                          segment_ids=segment_ids, scale=scale, block_q=block_q,
                          block_k=block_k, implementation=implementation)


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
                              causal: bool = False, kv_mask=None, segment_ids=None, scale=None,
                              q_offset=0):
    """DeepSeek sparse attention from the equations, densely (float32): the ``[Lq, Lk]``
    indexer scores, their top ``top_k`` keys (of the query's document, with
    ``segment_ids``) as a mask, one masked softmax (for tests and one decoding step; queries
    at ``q_offset + arange(Lq)``)."""
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
    segs = C.check_segment_ids("deepseek_sparse_reference", segment_ids, x.lq, x.lk)
    if segs is not None:
        ok = ok & (segs[0][:, None] == segs[1][None, :])
    val, idx = jax.lax.top_k(jnp.where(ok, score, -jnp.inf), min(top_k, x.lk))
    keep = jnp.zeros((x.lq, x.lk), bool).at[jnp.arange(x.lq)[:, None], idx].max(
        jnp.isfinite(val))
    s = jnp.where(keep, f(x.q) @ f(x.k).T * scale, -jnp.inf)
    p = jnp.where(keep, jnp.exp(s - jnp.max(jnp.where(keep, s, -1e30), -1, keepdims=True)), 0.0)
    out = p @ f(x.v) / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return out.astype(q.dtype)


def _kl_to_indexer(s, logits, keep, scale):
    """Per query ``KL(p || softmax(I))`` over the keys ``keep [cq, n]`` marks: ``s [cq, H, n]``
    the main attention's raw scores ``q . k`` of every head, ``logits [cq, n]`` the indexer's
    ``I``. ``p`` is the heads' softmax maps summed over heads and L1-normalised (DeepSeek-V3.2,
    Section 2.1.1). A query keeping no key gives 0."""
    s = jnp.where(keep[:, None], s * scale, -jnp.inf)
    p = jnp.where(keep[:, None], jnp.exp(s - safe_max(s.max(-1, keepdims=True))), 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    target = p.sum(1)
    target = target / jnp.maximum(target.sum(-1, keepdims=True), 1e-30)
    z = jnp.where(keep, logits, -jnp.inf)
    mz = jax.lax.stop_gradient(safe_max(z.max(-1, keepdims=True)))
    lse = mz + jnp.log(jnp.maximum(jnp.where(keep, jnp.exp(z - mz), 0.0).sum(-1, keepdims=True),
                                   1e-30))
    log_q = jnp.where(keep, z - lse, 0.0)
    pos = target > 0
    log_target = jnp.log(jnp.where(pos, target, 1.0))
    return jnp.where(pos, target * (log_target - log_q), 0.0).sum(-1)


def indexer_alignment_loss(
    q: Float[Array, "q_seq heads qk_dim"],
    k: Float[Array, "kv_seq kv_heads qk_dim"],
    q_index: Float[Array, "q_seq index_heads index_dim"],
    weights: Float[Array, "q_seq index_heads"],
    k_index: Float[Array, "kv_seq index_dim"],
    bits: UInt32[Array, "q_seq kv_words"] | None = None,
    *,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale: float | None = None,
    q_offset=0,
    chunk: int = 256,
) -> Float[Array, "q_seq"]:
    """The lightning indexer's training loss (DeepSeek-V3.2, Section 2.1.1): per query ``t``,
    ``KL(p_t || softmax(I_t))``, where ``p_t`` is the main attention's distribution over the
    keys (every head's softmax map summed over the heads, L1-normalised) and ``I_t`` the
    indexer's scores (Eq. 1) over the same keys.

    Two stages, as in the paper: the dense warm-up (``bits`` None: every key the query may
    see, ``causal`` and ``kv_mask``), and sparse training (``bits`` from
    ``lightning_indexer(..., return_bits=True)``: only the selected tokens ``S_t``, both
    distributions renormalised over them).

    Only the indexer learns from it: ``q`` and ``k`` are taken under ``stop_gradient`` (the
    target), so the gradient reaches ``q_index``, ``weights`` and ``k_index`` alone. The
    caller detaches the indexer's inputs from the main model (the paper's "separate
    optimisation"), as the ``dsa`` kind's layer does.

    Both stages run the same dense pass, ``chunk`` queries at a time under ``jax.checkpoint``
    (no ``[Lq, Lk]`` array; causal with a static ``q_offset``: each segment of chunks over the
    keys its last query sees), the sparse stage keeping the chosen keys by their bits: matmuls
    only, where gathering each query's chosen keys would scatter-add the indexer keys'
    gradients back (see :func:`deepseek_sparse_tiled`).

    Args:
      q: ``[Lq, H, D]`` the main attention's queries (all heads). k: ``[Lk, H_kv, D]`` its
        keys (``H_kv`` divides ``H``; head ``h`` reads key head ``h // (H / H_kv)``).
      q_index, weights, k_index: the indexer's ``[Lq, H_I, d_I]``, ``[Lq, H_I]``,
        ``[Lk, d_I]``.
      bits: the sparse stage's selection ``uint32[Lq, ceil(Lk / 32)]``, or None (dense).
      causal, kv_mask, q_offset: which keys may be seen (queries at ``q_offset +
        arange(Lq)``). segment_ids: packed-sequence ids: each query's distributions over its
        own document's keys. scale: the main attention's, ``1/sqrt(D)`` by default.
      chunk: queries at a time.

    Returns:
      ``f32[Lq]``: each query's KL divergence (0 for a query with no key).
    """
    name = "indexer_alignment_loss"
    lq, h, d = q.shape
    lk, hkv = k.shape[:2]
    hi, di = q_index.shape[1:]
    if (k.shape[2] != d or h % hkv or q_index.shape[0] != lq or weights.shape != (lq, hi)
            or k_index.shape != (lk, di)):
        raise ValueError(f"{name}: expected q [Lq, H, D], k [Lk, H_kv, D] (H_kv dividing H), "
                         f"q_index [Lq, H_I, d_I], weights [Lq, H_I], k_index [Lk, d_I]; got "
                         f"q{tuple(q.shape)}, k{tuple(k.shape)}, q_index{tuple(q_index.shape)}, "
                         f"weights{tuple(weights.shape)}, k_index{tuple(k_index.shape)}")
    nw = cdiv(lk, 32)
    if bits is not None and (bits.shape != (lq, nw) or bits.dtype != jnp.uint32):
        raise ValueError(f"{name}: bits must be None (dense stage) or uint32[Lq, ceil(Lk / "
                         f"32)] = [{lq}, {nw}]; got {bits.dtype}{tuple(bits.shape)}")
    C.check_positive_int(name, "chunk", chunk)
    scale = C.resolve_scale(d, scale)
    g = h // hkv
    real = jnp.ones((lk,), bool) if kv_mask is None else kv_mask
    segs = C.check_segment_ids(name, segment_ids, lq, lk)
    qf = jax.lax.stop_gradient(q).astype(STATS_DTYPE).reshape(lq, hkv, g, d)
    kf = jax.lax.stop_gradient(k).astype(STATS_DTYPE)
    kif = jnp.where(real[:, None], k_index.astype(STATS_DTYPE), 0.0)
    cq = min(chunk, lq)
    nc = cdiv(lq, cq)
    xs = {"q": pad_to(qf, nc * cq).reshape(nc, cq, hkv, g, d),
          "qi": pad_to(q_index.astype(STATS_DTYPE), nc * cq).reshape(nc, cq, hi, di),
          "w": pad_to(weights.astype(STATS_DTYPE), nc * cq).reshape(nc, cq, hi),
          "pos": (q_offset + jnp.arange(nc * cq)).reshape(nc, cq)}
    if bits is not None:
        xs["bits"] = pad_to(bits, nc * cq).reshape(nc, cq, nw)
    if segs is not None:
        xs["seg"] = pad_to(segs[0], nc * cq).reshape(nc, cq)

    def one(c, kif, width):
        s = jnp.einsum("qhgd,khd->qhgk", c["q"], kf[:width])
        logits = jnp.einsum("qj,qjk->qk", c["w"], jax.nn.relu(
            jnp.einsum("qjd,kd->qjk", c["qi"], kif[:width])))
        k_pos = jnp.arange(width)
        keep = jnp.broadcast_to(real[:width], (cq, width))
        if causal:
            keep = keep & (k_pos[None, :] <= c["pos"][:, None])
        if segs is not None:
            keep = keep & (c["seg"][:, None] == segs[1][None, :width])
        if bits is not None:
            word = jnp.take(c["bits"], k_pos >> 5, axis=1)
            keep = keep & ((jnp.right_shift(word, (k_pos & 31).astype(jnp.uint32)) & 1) == 1)
        return _kl_to_indexer(s.reshape(cq, h, width), logits, keep, scale)

    def run(width, part):
        step = jax.checkpoint(functools.partial(one, width=width))
        return jax.lax.map(lambda c: step(c, kif), part)

    if causal and isinstance(q_offset, int):
        nseg = min(_SEGMENTS, nc)
        bounds = [round(i * nc / nseg) for i in range(nseg + 1)]
        kl = jnp.concatenate([run(min(lk, max(q_offset + c1 * cq, 1)),
                                  {n: a[c0:c1] for n, a in xs.items()})
                              for c0, c1 in zip(bounds[:-1], bounds[1:])], 0)
    else:
        kl = run(lk, xs)
    return kl.reshape(-1)[:lq]
