"""Sliding-window attention with the sequence split over a mesh axis, by halo exchange.

A query of the window pattern ``Local(left, right)`` (Beltagy et al., 2020; Child et al., 2019)
sees only the ``left`` keys before it and the ``right`` keys after it, so a device holding a
contiguous shard of ``c`` positions needs just the last ``left`` keys of the shard before and
the first ``right`` keys of the shard after: one ``lax.ppermute`` each way (the halo exchange
of stencil codes). Each device then runs the block-sparse kernel on ``[halo, own, halo]``, with
its own queries placed between ``left`` and ``right`` dummy rows so that the square
``Local(left, right)`` layout is exactly the window of every real query; the dummy rows' output
is dropped. Work and memory per device are ``O((c + left + right) (left + right))`` and the
communication is ``(left + right)`` keys and values per step, independent of the length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from .. import axes as X
from ..kernels import pad_to
from . import _contract as C
from ._exact import block_sparse_attention
from .patterns import Local

_NAME = "halo_local_attention"


def _shard(axis, n, left, right, causal, scale, block_q, block_k, q, k, v, mask):
    c = q.shape[0]
    to_next = [(i, i + 1) for i in range(n - 1)]
    to_prev = [(i + 1, i) for i in range(n - 1)]
    # A device with no neighbour receives zeros: a mask of False, so the halo is ignored.
    parts_k, parts_v, parts_m = [], [], []
    if left:
        parts_k.append(lax.ppermute(k[c - left:], axis, to_next))
        parts_v.append(lax.ppermute(v[c - left:], axis, to_next))
        parts_m.append(lax.ppermute(mask[c - left:], axis, to_next))
    parts_k.append(k), parts_v.append(v), parts_m.append(mask)
    if right:
        parts_k.append(lax.ppermute(k[:right], axis, to_prev))
        parts_v.append(lax.ppermute(v[:right], axis, to_prev))
        parts_m.append(lax.ppermute(mask[:right], axis, to_prev))
    kk, vv, mm = (jnp.concatenate(p) for p in (parts_k, parts_v, parts_m))
    qq = jnp.concatenate([jnp.zeros((left, q.shape[1]), q.dtype), q,
                          jnp.zeros((right, q.shape[1]), q.dtype)])
    out = block_sparse_attention(qq, kk, vv, Local(left, right), causal=causal, kv_mask=mm,
                                 scale=scale, block_q=block_q, block_k=block_k)
    return out[left:left + c]


def halo_local_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *,
    left: int,
    right: int = 0,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    mesh=None,
    axis_name: str = X.SEQUENCE,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Float[Array, "q_seq v_dim"]:
    """``block_sparse_attention(q, k, v, Local(left, right))`` with the sequence sharded.

    Equal to it (gradients by autodiff through ``shard_map``) for self-attention. Without a
    mesh, or an axis of size 1, it is that call. The length is padded to a multiple of the axis
    size with masked keys.

    Args:
      q: ``[L, Dk]``. k: ``[L, Dk]``. v: ``[L, Dv]`` (self-attention: one length).
      left, right: the window: query i sees keys ``i - left .. i + right``.
      causal: also ``j <= i`` (the window's right part is then empty).
      kv_mask: ``bool[L]``, True for real keys.
      scale: score scale, ``1/sqrt(Dk)`` by default.
      mesh: default the active mesh (``xformers_jax.axes.active``).
      axis_name: the mesh axis the sequence is split over.
      block_q, block_k: tile sizes of the block-sparse kernel on each device.

    Returns:
      ``[L, Dv]`` in q's dtype.

    Raises:
      ValueError: when a halo is longer than a shard (``left`` or ``right`` greater than
        ``L / n``), naming the sizes; use fewer sequence shards or a narrower window.
    """
    x, kv_mask = C.check_qkv_mask(_NAME, q, k, v, kv_mask)
    C.check_same_length(_NAME, x, "the sequence is split alike for queries and keys")
    pattern = Local(left, 0 if causal else right)  # checks the sizes
    left, right = pattern.left, pattern.right
    scale = C.resolve_scale(x.dk, scale)
    mesh, n = X.mesh_for(axis_name, mesh)
    if n == 1:
        return block_sparse_attention(x.q, x.k, x.v, pattern, causal=causal,
                                      kv_mask=kv_mask, scale=scale, block_q=block_q,
                                      block_k=block_k)
    length = -(-x.lq // n) * n
    c = length // n
    if max(left, right) > c:
        raise ValueError(
            f"{_NAME}: the window (left={left}, right={right}) is longer than a shard of "
            f"{c} positions (length {x.lq} over {n} devices); a halo comes from one neighbour, "
            "so use fewer sequence shards or a narrower window")
    mask = jnp.ones((x.lq,), bool) if kv_mask is None else kv_mask
    args = (pad_to(x.q, length), pad_to(x.k, length), pad_to(x.v, length),
            pad_to(mask, length, value=False))
    spec = P(axis_name)
    fn = functools.partial(_shard, axis_name, n, left, right, bool(causal), float(scale),
                           block_q, block_k)
    # jit: a shard_map over some of the mesh axes cannot run eagerly.
    out = jax.jit(jax.shard_map(
        fn, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec,
        axis_names=frozenset({axis_name}), check_vma=False,
    ))(*args)
    return out[: x.lq]
