"""Native sparse attention (Yuan et al., 2025, "Native Sparse Attention: Hardware-Aligned and
Natively Trainable Sparse Attention", Section 3, Eqs. 5-11).

Each query attends three ways and mixes them with learned sigmoid gates (Eq. 5):

    o_t = g_cmp attn(q_t, K_cmp, V_cmp) + g_slc attn(q_t, K_slc, V_slc) + g_win attn(q_t, K_win, V_win)

- compressed (Eq. 7): one key and one value per block of ``block_size`` tokens, pooled; a
  query sees the blocks it has wholly seen (causal);
- selected (Eqs. 8-11): the blocks with the highest compressed attention scores
  ``softmax(q_t K_cmp^T)`` (selection blocks = compression blocks, the paper's ``l' = l = d``
  case), attended token by token: ``num_selected`` blocks, the query's own block always
  among them when causal (the paper's always-active local block);
- sliding (Eq. 11's neighbour): the last ``window`` keys.

Differences from the paper, stated: the compression ``phi`` is the mean of a block's keys
(values) rather than a learned MLP with intra-block positions, blocks do not overlap (stride =
block length), and each head chooses its own blocks (the paper shares one choice across a
group of query heads so a GPU kernel loads each block once per group).

Fast form: the compressed branch is softmax over ``L / block_size`` pooled keys; the selected
branch is MoBA's (``_moba``: the own block on the tiled kernel, the chosen past blocks key
block by key block); the sliding branch is the tiled kernel with ``Local(window - 1, 0)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ...kernels import STATS_DTYPE, safe_max
from .. import _contract as C
from .._exact import flash_attention
from ..patterns import Local
from ._moba import chosen_and_own_blocks, pooled_blocks, select_blocks


def _softmax_rows(s, keep, v):
    """``(softmax(s) v f32[Lq, Dv], lse f32[Lq])`` over the entries ``keep`` marks; a row that
    keeps nothing gives zeros and ``-inf``."""
    s = jnp.where(keep, s, -jnp.inf)
    m = safe_max(s.max(-1, keepdims=True))
    p = jnp.where(keep, jnp.exp(s - m), 0.0)
    l = p.sum(-1, keepdims=True)
    out = p @ v.astype(STATS_DTYPE) / jnp.maximum(l, 1e-30)
    return out, jnp.where(l[:, 0] > 0, m[:, 0] + jnp.log(jnp.maximum(l[:, 0], 1e-30)), -jnp.inf)


def _compressed(qf, k, v, kv_mask, q_pos, block_size, causal, scale):
    """The compressed branch and the blocks' scores: ``(out f32[Lq, Dv], scores f32[Lq, nb],
    real bool[nb])``."""
    kc, real = pooled_blocks(k, kv_mask, block_size)
    vc, _ = pooled_blocks(v, kv_mask, block_size)
    nb = kc.shape[0]
    s = qf @ kc.T * scale
    keep = jnp.broadcast_to(real, s.shape)
    if causal:  # block i is compressed once its last token is seen
        keep = keep & ((jnp.arange(nb)[None, :] + 1) * block_size - 1 <= q_pos[:, None])
    out, _ = _softmax_rows(s, keep, vc)
    return out, s, real


def _check(name, block_size, num_selected, window, gates, lq):
    C.check_positive_int(name, "block_size", block_size)
    C.check_positive_int(name, "num_selected", num_selected)
    C.check_positive_int(name, "window", window)
    if gates.shape != (lq, 3):
        raise ValueError(f"{name}: gates must be [Lq, 3] = [{lq}, 3] (compressed, selected, "
                         f"sliding), got {tuple(gates.shape)}")


def native_sparse_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    gates: Float[Array, "q_seq 3"],
    *,
    block_size: int = 64,
    num_selected: int = 4,
    window: int = 256,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    key=None,
    chunk: int = 256,
    implementation: str | None = None,
) -> Float[Array, "q_seq v_dim"]:
    """Native sparse attention of one head (Yuan et al., 2025, Eq. 5).

    Args:
      q: ``[Lq, D]``. k: ``[Lk, D]``. v: ``[Lk, Dv]``.
      gates: ``[Lq, 3]`` in ``[0, 1]``, each query's weights of its compressed, selected and
        sliding branches (the paper's sigmoid of an MLP of the input).
      block_size: tokens per compressed (and selected) block. num_selected: blocks each
        query attends in full (causal: its own and ``num_selected - 1`` chosen past blocks).
      window: keys of the sliding branch (the query's and the ``window - 1`` before it; not
        causal: as many after it).
      causal, kv_mask, key: the contract's (self-attention positions when causal).
      scale: ``1/sqrt(D)`` by default. chunk: query rows per tile of one selected key
      block. implementation: the tiled kernel's.

    Returns:
      ``[Lq, Dv]`` in q's dtype, equal to :func:`native_sparse_reference`.
    """
    name = "native_sparse_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    _check(name, block_size, num_selected, window, gates, x.lq)
    if causal and x.lq != x.lk:
        raise ValueError(f"{name}: causal=True is self-attention (query i at position i); got "
                         f"q{tuple(q.shape)}, k{tuple(k.shape)}")
    scale = C.resolve_scale(x.dk, scale)
    q_pos = jnp.arange(x.lq)
    cmp, scores, real = _compressed(x.q.astype(STATS_DTYPE), x.k, x.v, kv_mask, q_pos,
                                    block_size, causal, scale)
    idx, chosen = select_blocks(jax.lax.stop_gradient(scores), real, q_pos, block_size,
                                num_selected, causal)
    slc = chosen_and_own_blocks(x.q, x.k, x.v, idx, chosen, block_size=block_size,
                                kv_mask=kv_mask, scale=scale, causal=causal, chunk=chunk,
                                implementation=implementation)
    win = flash_attention(x.q, x.k, x.v, causal=causal, kv_mask=kv_mask, scale=scale,
                          pattern=Local(window - 1, 0 if causal else window - 1),
                          implementation=implementation)
    g = gates.astype(STATS_DTYPE)
    out = g[:, :1] * cmp + g[:, 1:2] * slc + g[:, 2:] * win.astype(STATS_DTYPE)
    return out.astype(q.dtype)


def native_sparse_reference(q, k, v, gates, *, block_size: int, num_selected: int,
                            window: int, causal: bool = False, kv_mask=None, scale=None,
                            q_offset=0):
    """:func:`native_sparse_attention` with each branch's keys as a dense ``[Lq, Lk]`` mask
    (float32): the paper's equations, for tests and for one decoding step (queries at
    positions ``q_offset + arange(Lq)``; ``q_offset`` may be traced)."""
    name = "native_sparse_reference"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    _check(name, block_size, num_selected, window, gates, x.lq)
    scale = C.resolve_scale(x.dk, scale)
    q_pos = q_offset + jnp.arange(x.lq)
    k_pos = jnp.arange(x.lk)
    qf = x.q.astype(STATS_DTYPE)
    cmp, scores, real = _compressed(qf, x.k, x.v, kv_mask, q_pos, block_size, causal, scale)
    idx, chosen = select_blocks(scores, real, q_pos, block_size, num_selected, causal)
    nb = scores.shape[1]
    sel = jnp.zeros((x.lq, nb), bool).at[jnp.arange(x.lq)[:, None], idx].max(chosen)
    real_keys = jnp.ones((x.lk,), bool) if kv_mask is None else kv_mask
    seen = real_keys[None, :] & ((k_pos[None, :] <= q_pos[:, None]) if causal else True)
    slc_keep = sel[:, k_pos // block_size]
    if causal:
        slc_keep = slc_keep | (k_pos[None, :] // block_size == q_pos[:, None] // block_size)
    dist = q_pos[:, None] - k_pos[None, :]
    win_keep = (dist < window) & (causal | (-dist < window))
    s = qf @ x.k.astype(STATS_DTYPE).T * scale
    slc, _ = _softmax_rows(s, slc_keep & seen, x.v)
    win, _ = _softmax_rows(s, win_keep & seen, x.v)
    g = gates.astype(STATS_DTYPE)
    return (g[:, :1] * cmp + g[:, 1:2] * slc + g[:, 2:] * win).astype(q.dtype)
