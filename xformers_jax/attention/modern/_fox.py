"""Forgetting attention: softmax attention with a data-dependent forget gate (Lin, Nikishin, He
and Courville, 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate", Eqs. 5-7).

Each head has a scalar forget gate per token, ``f_t = sigmoid(w_f^T x_t + b_f)``, and a query
down-weights a key by the gates of the tokens between them:

    o_i = sum_{j <= i} softmax_j(q_i . k_j / sqrt(d) + D_ij) v_j,
    D_ij = sum_{l = j+1}^{i} log f_l = c_i - c_j,     c_t = sum_{l <= t} log f_l.

``D`` is a score function on the tiled kernel (``flex_attention``): the cumulative log-gates
``c`` are captured per head, so no ``L x L`` array is formed and the gradient reaches the
gates through the kernel's backward. The gates are summed in log space and in float32 (a
product of sigmoids underflows after a few hundred tokens).

Padded tokens forget nothing (``log f = 0`` there), so padding in the middle of a row is as if
it were absent. Without ``causal`` (an extension: the paper is causal) the gates decay both
ways, ``D_ij = -|c_i - c_j|``, which equals the paper's ``D_ij`` for ``j <= i``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ...kernels import STATS_DTYPE
from .. import _contract as C
from .._flex import document_sum, flex_attention


def _check_gates(name: str, log_f, length: int, k):
    if log_f.shape != (length,) or not jnp.issubdtype(log_f.dtype, jnp.floating):
        raise ValueError(f"{name}: log_f must be float[L] (one log forget gate per token of "
                         f"this self-attention), got {log_f.dtype}{tuple(log_f.shape)} for "
                         f"k{tuple(k.shape)}")


def cumulative_log_gates(log_f: Float[Array, "seq"],
                         kv_mask: Bool[Array, "seq"] | None = None,
                         segment_ids=None) -> Float[Array, "seq"]:
    """``c_t = sum_{l <= t} log f_l`` in float32, padded tokens (``kv_mask`` False)
    contributing 0: ``D_ij = c_i - c_j`` is the log-decay from key ``j`` to query ``i``.

    With packed-sequence ids ``segment_ids int[L]`` the sum restarts at each document's first
    token, so ``c`` within a document is that document's own (the same numbers as the
    document alone, not a difference of large row-long sums)."""
    log_f = log_f.astype(STATS_DTYPE)
    if kv_mask is not None:
        log_f = jnp.where(kv_mask, log_f, 0.0)
    return jnp.cumsum(log_f) if segment_ids is None else document_sum(segment_ids, log_f)


def _decay(c, q_idx, kv_idx, causal: bool):
    d = c[q_idx] - c[kv_idx]
    return d if causal else -jnp.abs(d)


def forgetting_attention(
    q: Float[Array, "seq qk_dim"],
    k: Float[Array, "seq qk_dim"],
    v: Float[Array, "seq v_dim"],
    log_f: Float[Array, "seq"],
    *,
    causal: bool = True,
    kv_mask: Bool[Array, "seq"] | None = None,
    segment_ids=None,
    scale: float | None = None,
    key=None,
    block_q: int | None = None,
    block_k: int | None = None,
    implementation: str | None = None,
) -> Float[Array, "seq v_dim"]:
    """Forgetting attention of one head (Lin et al., 2025) on the tiled kernel, in O(L) memory.

    Args:
      q: ``[L, Dk]``. k: ``[L, Dk]``. v: ``[L, Dv]`` (self-attention: the gates are per token).
      log_f: ``[L]``, ``log f_t = log sigmoid(w_f^T x_t + b_f)`` of this head (``<= 0``);
        differentiable.
      causal: query ``i`` sees keys ``j <= i`` with ``D_ij = c_i - c_j`` (the paper's); False:
        every key, ``D_ij = -|c_i - c_j|``.
      kv_mask: the contract's key padding; a padded token's gate is taken as ``f = 1``.
      segment_ids: packed-sequence ids ``int[L]``: a query sees the keys of its own document
        only, and the gates' sums restart at each document (:func:`cumulative_log_gates`).
      scale: ``1/sqrt(Dk)`` by default. key: unused (no dropout).
      block_q, block_k, implementation: the tiled kernel's (``flex_attention``).

    Returns:
      ``[L, Dv]`` in q's dtype. With every ``log_f = 0`` it is softmax attention.
    """
    name = "forgetting_attention"
    del key
    x = C.check_qkv(name, q, k, v)
    C.check_same_length(name, x, "the forget gates are per token, so it needs self-attention "
                        "(Lq == Lk)")
    _check_gates(name, log_f, x.lk, k)
    kv_mask = C.check_kv_mask(name, kv_mask, x.lk)
    if isinstance(segment_ids, (tuple, list)):
        raise ValueError(f"{name}: segment_ids must be one int[L] array (the gates are per "
                         "token of this self-attention), got a (q, kv) pair")
    C.check_segment_ids(name, segment_ids, x.lq, x.lk)
    c = cumulative_log_gates(log_f, kv_mask, segment_ids)

    def forget(score, b, h, q_idx, kv_idx):
        return score + _decay(c, q_idx, kv_idx, causal)

    return flex_attention(q, k, v, score_mod=forget, causal=causal, kv_mask=kv_mask,
                          segment_ids=segment_ids, scale=scale, block_q=block_q,
                          block_k=block_k, implementation=implementation)


def forgetting_attention_reference(q, k, v, log_f, *, causal: bool = True, kv_mask=None,
                                   segment_ids=None, scale=None):
    """:func:`forgetting_attention` as the paper writes it (for tests): the ``[L, L]`` matrix
    ``D_ij = sum_{l=j+1}^{i} log f_l`` summed term by term (no cumulative differences), added
    to the dense scores, masked (and to each document, with ``segment_ids int[L]``), softmax,
    times ``v``; float32 throughout."""
    name = "forgetting_attention_reference"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    _check_gates(name, log_f, x.lk, k)
    n = x.lk
    g = log_f.astype(STATS_DTYPE)
    if kv_mask is not None:
        g = jnp.where(kv_mask, g, 0.0)
    i, j, l_ = (jnp.arange(n)[:, None, None], jnp.arange(n)[None, :, None],
                jnp.arange(n)[None, None, :])
    between = (l_ > jnp.minimum(i, j)) & (l_ <= jnp.maximum(i, j))  # l in (j, i] or (i, j]
    d = -jnp.abs(jnp.sum(jnp.where(between, g, 0.0), -1))  # sum of log f <= 0 either way
    s = (x.q.astype(STATS_DTYPE) @ x.k.astype(STATS_DTYPE).T) * C.resolve_scale(x.dk, scale) + d
    keep = jnp.ones((n, n), bool) if kv_mask is None else jnp.broadcast_to(kv_mask, (n, n))
    if causal:
        keep = keep & (j[..., 0] <= i[..., 0])
    if segment_ids is not None:
        seg = jnp.asarray(segment_ids)
        keep = keep & (seg[:, None] == seg[None, :])
    s = jnp.where(keep, s, -jnp.inf)
    p = jnp.where(keep, jax.nn.softmax(jnp.where(keep, s, -1e30), axis=-1), 0.0)
    return (p @ x.v.astype(STATS_DTYPE)).astype(q.dtype)


def forgetting_decode_step(q, k, v, log_f, *, valid, scale=None):
    """One decoding step of one head over a cache (exact; for ``KVDecoding``): the query at
    position ``t`` (the last valid slot) over cached keys ``k [C, Dk]``, values ``v [C, Dv]``
    and their log gates ``log_f [C]``, ``valid bool[C]`` marking the filled slots ``0..t``.
    ``D_tj = c_t - c_j`` from the cached gates, so the cache keeps one gate per token."""
    c = cumulative_log_gates(log_f, valid)
    x, valid = C.check_qkv_mask("forgetting_decode_step", q, k, v, valid)
    s = (x.q.astype(STATS_DTYPE) @ x.k.astype(STATS_DTYPE).T) * C.resolve_scale(x.dk, scale)
    s = jnp.where(valid, s + (c[-1] - c), -1e30)  # c[-1]: invalid slots add 0, so c[-1] = c_t
    p = jnp.where(valid, jax.nn.softmax(s, axis=-1), 0.0)
    return (p @ x.v.astype(STATS_DTYPE)).astype(q.dtype)
