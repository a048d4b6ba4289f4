"""Multi-head latent attention (DeepSeek-AI, 2024, "DeepSeek-V2", Section 2.1, Eqs. 9-19).

Keys and values of every head come from one low-rank latent per token,

    c_KV = x W_DKV                    [d_c]           (the only per-token cache, with k_R)
    k_C  = c_KV W_UK   (per head)     [d_nope]        v = c_KV W_UV (per head) [d_v]
    k_R  = RoPE(x W_KR)               [d_R]           (one decoupled rotary key, shared by heads)
    q    = [q_C; RoPE(q_R)]           [d_nope + d_R]  (q from x, or compressed: c_Q = x W_DQ)

and each head attends with ``q . [k_C; k_R] / sqrt(d_nope + d_R)`` over ``v``. Rotary
positions cannot pass through ``W_UK`` (a rotation between ``q_C`` and ``W_UK^T`` depends on
the distance), hence the separate shared ``k_R``.

Two equal forms of one head (:func:`multi_head_latent_attention`):

- naive (training): materialise ``k = [c_KV W_UK; k_R]`` and ``v = c_KV W_UV`` and run the
  tiled kernel;
- absorbed (decoding, the paper's "W_UK absorbed into W_Q, W_UV into W_O"): the query
  becomes ``[q_C W_UK^T; q_R]`` of width ``d_c + d_R``, the keys are ``[c_KV; k_R]`` and the
  values ``c_KV`` themselves, and ``W_UV`` maps the latent output back; one step reads only
  the cached latent, never a per-head key.

The cache holds ``d_c + d_R`` numbers per token and layer against multi-head attention's
``2 H d_h`` (:func:`mla_cache_bytes_per_token`, :func:`mha_cache_bytes_per_token`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from ...kernels import STATS_DTYPE
from .. import _contract as C
from .._exact import flash_attention


def rotary(x: Float[Array, "... dim"], positions, base: float = 10000.0) -> Float[Array, "... dim"]:
    """Rotary position embedding (Su et al., 2021) of ``x [..., d]`` (``d`` even) at integer
    ``positions`` broadcasting against ``x.shape[:-1]``: channel pairs ``(i, i + d/2)`` rotated
    by ``pos * base^(-2i/d)``, computed in float32, returned in x's dtype."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary: the rotated width must be even, got x{tuple(x.shape)}")
    freq = base ** (-np.arange(d // 2, dtype=np.float32) * 2.0 / d)
    ang = jnp.asarray(positions, STATS_DTYPE)[..., None] * freq
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    a, b = x[..., : d // 2].astype(STATS_DTYPE), x[..., d // 2:].astype(STATS_DTYPE)
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(x.dtype)


def multi_head_latent_attention(
    q: Float[Array, "q_seq qk_dim"],
    c_kv: Float[Array, "kv_seq latent"],
    k_rope: Float[Array, "kv_seq rope"],
    w_uk: Float[Array, "latent nope"],
    w_uv: Float[Array, "latent v_dim"],
    *,
    absorb: bool = False,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale: float | None = None,
    key=None,
    block_q: int | None = None,
    block_k: int | None = None,
    implementation: str | None = None,
) -> Float[Array, "q_seq v_dim"]:
    """One head of multi-head latent attention over the cached latent (DeepSeek-V2, Eqs. 9-19).

    Args:
      q: ``[Lq, d_nope + d_R]``, the content part then the rotary part (already rotated).
      c_kv: ``[Lk, d_c]``, the joint key/value latent. k_rope: ``[Lk, d_R]``, the shared
        rotary key (already rotated).
      w_uk: ``[d_c, d_nope]``, this head's key up-projection. w_uv: ``[d_c, d_v]``, its value
        up-projection.
      absorb: False: materialise this head's keys and values (training); True: absorb
        ``w_uk`` into the query and ``w_uv`` into the output, attending over the latent itself
        (decoding). Both are the same function, up to rounding.
      causal, kv_mask, key: the contract's. segment_ids: packed-sequence ids (as
        ``flash_attention``'s; the caller rotates with positions that restart per document).
      scale: ``1/sqrt(d_nope + d_R)`` by default.
      block_q, block_k, implementation: the tiled kernel's.

    Returns:
      ``[Lq, d_v]`` in q's dtype.
    """
    name = "multi_head_latent_attention"
    x, kv_mask = C.check_qkv_mask(name, c_kv, c_kv, k_rope, kv_mask)
    c_kv, k_rope = x.k, x.v
    d_c, d_r = c_kv.shape[1], k_rope.shape[1]
    if q.ndim != 2 or w_uk.shape[0] != d_c or w_uv.shape[0] != d_c \
            or q.shape[1] != w_uk.shape[1] + d_r:
        raise ValueError(
            f"{name}: expected q [Lq, d_nope + d_R], c_kv [Lk, d_c], k_rope [Lk, d_R], w_uk "
            f"[d_c, d_nope], w_uv [d_c, d_v]; got q{tuple(q.shape)}, c_kv{tuple(c_kv.shape)}, "
            f"k_rope{tuple(k_rope.shape)}, w_uk{tuple(w_uk.shape)}, w_uv{tuple(w_uv.shape)}")
    scale = C.resolve_scale(q.shape[1], scale)
    d_nope = w_uk.shape[1]
    kw = {"causal": causal, "kv_mask": kv_mask, "segment_ids": segment_ids, "scale": scale,
          "block_q": block_q, "block_k": block_k, "implementation": implementation}
    dt = q.dtype
    if absorb:
        q_lat = (q[:, :d_nope].astype(STATS_DTYPE) @ w_uk.astype(STATS_DTYPE).T).astype(dt)
        o_lat = flash_attention(jnp.concatenate([q_lat, q[:, d_nope:]], -1),
                                jnp.concatenate([c_kv.astype(dt), k_rope.astype(dt)], -1),
                                c_kv.astype(dt), **kw)
        return (o_lat.astype(STATS_DTYPE) @ w_uv.astype(STATS_DTYPE)).astype(dt)
    k = jnp.concatenate([(c_kv @ w_uk.astype(c_kv.dtype)).astype(dt), k_rope.astype(dt)], -1)
    v = (c_kv @ w_uv.astype(c_kv.dtype)).astype(dt)
    return flash_attention(q, k, v, **kw)


def multi_head_latent_attention_reference(q, c_kv, k_rope, w_uk, w_uv, *, causal=False,
                                          kv_mask=None, segment_ids=None, scale=None):
    """:func:`multi_head_latent_attention` from the paper's equations, densely in float32:
    ``softmax(q [c_KV W_UK; k_R]^T * scale) c_KV W_UV`` with masked keys removed, and keys
    of other documents with ``segment_ids int[L]`` (for tests)."""
    q, c_kv, k_rope, w_uk, w_uv = (jnp.asarray(a, STATS_DTYPE)
                                   for a in (q, c_kv, k_rope, w_uk, w_uv))
    lq, lk = q.shape[0], c_kv.shape[0]
    keep = jnp.ones((lq, lk), bool) if kv_mask is None else jnp.broadcast_to(kv_mask, (lq, lk))
    c_kv = jnp.where(keep[0][:, None], c_kv, 0.0)
    k_rope = jnp.where(keep[0][:, None], k_rope, 0.0)
    if causal:
        keep = keep & (jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None])
    if segment_ids is not None:
        seg = jnp.asarray(segment_ids)
        keep = keep & (seg[:, None] == seg[None, :])
    scale = C.resolve_scale(q.shape[1], scale)
    s = q @ jnp.concatenate([c_kv @ w_uk, k_rope], -1).T * scale
    s = jnp.where(keep, s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, -1, keepdims=True))
    p = jnp.where(keep, p, 0.0)
    return (p / p.sum(-1, keepdims=True)) @ (c_kv @ w_uv)


def mla_cache_bytes_per_token(latent_dim: int, rope_dim: int, *, num_layers: int = 1,
                              dtype=jnp.bfloat16) -> int:
    """Bytes multi-head latent attention caches per token: ``(d_c + d_R)`` numbers per layer
    (DeepSeek-V2, Table 1: ``(d_c + d_h^R) l``)."""
    return (latent_dim + rope_dim) * num_layers * jnp.dtype(dtype).itemsize


def mha_cache_bytes_per_token(num_kv_heads: int, head_dim: int, *, num_layers: int = 1,
                              dtype=jnp.bfloat16) -> int:
    """Bytes a key/value cache holds per token: ``2 n_h d_h`` numbers per layer (multi-head
    attention; grouped-query attention with ``num_kv_heads`` heads)."""
    return 2 * num_kv_heads * head_dim * num_layers * jnp.dtype(dtype).itemsize
