"""Low-rank attention with a band branch (low-rank and locality constrained self-attention).

Guo, Qiu, Xue, Zhang, "Low-Rank and Locality Constrained Self-Attention for Sequence Modeling"
(IEEE/ACM TASLP 2019). The attention matrix is treated as a matrix
decomposition into two modules: a *low-rank* attention whose queries and keys live in a small
``r``-dimensional space (``D_k = r`` bounds the rank of its score matrix, the low-rank inductive
bias), capturing long-range, non-local interactions; and a *band* attention (query i sees
``|i - j| <= window``), capturing local dependencies. Here the two row-stochastic matrices are
mixed with a learned weight, ``A = (1 - g) A_lowrank + g A_band`` with ``g = sigmoid(gate)``, so
each row stays a distribution; ``A V`` is then ``(1 - g) A_lowrank V + g A_band V``, two exact
attentions (:func:`flash_attention`) that never build the ``L x L`` matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from ... import kernels
from .._exact import flash_attention
from ..patterns import Local


def init_lowrank_band(key, dk: int, rank: int, *, gate: float = 0.0, dtype=jnp.float32):
    """The arrays of :func:`lowrank_band_attention`: ``(w_q [dk, rank], w_k [dk, rank], gate [])``.

    ``w_q`` and ``w_k`` are ``N(0, 1/dk)`` projections into the low-rank space; ``gate`` is the
    mixing logit (``0`` weighs both branches equally).
    """
    name = "init_lowrank_band"
    dk = C.check_positive_int(name, "dk", dk)
    rank = C.check_positive_int(name, "rank", rank)
    kq, kk = jax.random.split(key)
    w = lambda k: (dk ** -0.5 * jax.random.normal(k, (dk, rank))).astype(dtype)
    return w(kq), w(kk), jnp.asarray(gate, dtype)


def lowrank_band_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    w_q,
    w_k,
    gate,
    *,
    window: int,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale: float | None = None,
    lowrank_scale: float | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Low-rank plus band attention for one sequence and one head.

    ``out = (1 - g) softmax(s_r (q W_q)(k W_k)^T) v + g softmax_band(s q k^T) v`` with
    ``g = sigmoid(gate)``. The band keeps keys ``|i - j| <= window`` (causal: ``i - window <= j
    <= i``, positions counted from the start of both sequences). Both branches decode: the
    low-rank projection acts on features, not on positions, so ``causal=True`` is the causal
    mask on both. A query for which one branch sees no key (all its keys masked) takes the
    other branch alone, so every row of the mixed matrix remains a distribution.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      w_q, w_k: ``[Dk, r]`` projections into the low-rank space (:func:`init_lowrank_band`).
      gate: scalar mixing logit; ``sigmoid(gate)`` is the band branch's weight.
      window: band half-width (causal: how far back), a non-negative integer.
      causal: query i sees keys ``j <= i`` only, in both branches.
      kv_mask: ``bool[Lk]``, True for real keys.
      segment_ids: packed-sequence ids (as ``flash_attention``'s): both branches stay inside
        each document (the projections act per token and the band on ``i - j``, so each
        document gets its own result).
      scale: band score scale, ``1/sqrt(Dk)`` by default.
      lowrank_scale: low-rank score scale, ``1/sqrt(r)`` by default.

    Returns:
      ``[Lq, Dv]`` in q's dtype.
    """
    name = "lowrank_band_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    w_q, w_k, gate = jnp.asarray(w_q), jnp.asarray(w_k), jnp.asarray(gate)
    if w_q.ndim != 2 or w_q.shape[0] != x.dk or w_k.shape != w_q.shape:
        raise ValueError(
            f"{name}: w_q and w_k must both be [Dk, r] with Dk={x.dk} but got "
            f"w_q{tuple(w_q.shape)}, w_k{tuple(w_k.shape)}"
        )
    if gate.shape != ():
        raise ValueError(f"{name}: gate must be a scalar but has shape {tuple(gate.shape)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"{name}: window must be a non-negative integer but got {window!r}")
    rank = w_q.shape[1]
    project = lambda a, w: jnp.einsum(
        "ld,dr->lr", a, w, preferred_element_type=C.STATS_DTYPE).astype(x.q.dtype)
    far, lse_far = flash_attention(
        project(x.q, w_q), project(x.k, w_k), x.v, causal=causal, kv_mask=kv_mask,
        segment_ids=segment_ids, scale=C.resolve_scale(rank, lowrank_scale), return_lse=True)
    band, lse_band = flash_attention(
        x.q, x.k, x.v, pattern=Local(window, 0 if causal else window), causal=causal,
        kv_mask=kv_mask, segment_ids=segment_ids, scale=scale, return_lse=True)
    g = jax.nn.sigmoid(gate.astype(C.STATS_DTYPE))
    # A branch that saw no key returned zeros; its weight moves to the other branch.
    w_far = jnp.where(jnp.isneginf(lse_far), 0.0, 1.0 - g)
    w_band = jnp.where(jnp.isneginf(lse_band), 0.0, g)
    return kernels.merge_weighted((far, band), (w_far, w_band)).astype(x.q.dtype)
