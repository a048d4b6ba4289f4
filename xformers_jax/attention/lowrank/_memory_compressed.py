"""Memory-compressed attention combined with local blocks.

Liu et al., "Generating Wikipedia by Summarizing Long Sequences" (2018). Keys and values are
compressed by a strided convolution (kernel = stride = c), which shortens the memory c times;
each query attends jointly over the keys of its own contiguous block and over the compressed
memory, with one softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._dense import dot_product_attention


def init_memory_compression(key, stride: int, dk: int, dv: int, *, dtype=jnp.float32):
    """Strided-conv kernels ``(Wk [c, Dk, Dk], Wv [c, Dv, Dv])``, ``N(0, 1/(c D))``, so a
    compressed key has the scale of one key."""
    name = "init_memory_compression"
    c = C.check_positive_int(name, "stride", stride)
    dk, dv = C.check_positive_int(name, "dk", dk), C.check_positive_int(name, "dv", dv)
    kk, kv = jax.random.split(key)
    return ((c * dk) ** -0.5 * jax.random.normal(kk, (c, dk, dk))).astype(dtype), (
        (c * dv) ** -0.5 * jax.random.normal(kv, (c, dv, dv))).astype(dtype)


def compress(x, weight):
    """Strided convolution of ``x [L, D]`` with ``weight [c, D, D']`` (kernel = stride = c):
    ``[ceil(L / c), D']``, the tail zero-padded."""
    c = weight.shape[0]
    x = jnp.pad(x, ((0, -x.shape[0] % c), (0, 0)))
    return jnp.einsum("jtd,tde->je", x.reshape(-1, c, x.shape[1]), weight,
                      preferred_element_type=C.STATS_DTYPE)


def memory_compressed_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    wk,
    wv,
    *,
    block_size: int,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Local-block plus memory-compressed attention for one sequence and one head.

    Query i (in block ``b = i // block_size``) attends with one softmax over the keys of block
    b and the ``ceil(L / c)`` compressed slots. Causal form: within the block only keys
    ``j <= i``, and only compressed slots whose whole window ``[s c, (s+1) c)`` lies at or
    before i, so no future token reaches i. Cost ``O(L (block_size + L / c))``.

    Args:
      q: ``[L, Dk]``. k: ``[L, Dk]``. v: ``[L, Dv]`` (self-attention: ``Lq == Lk``).
      wk: ``[c, Dk, Dk]``, wv: ``[c, Dv, Dv]`` compression kernels
        (:func:`init_memory_compression`).
      block_size: length of the contiguous local blocks.
      causal: query i sees tokens ``j <= i`` only.
      kv_mask: ``bool[L]``; masked keys are zeroed before compression, and a slot of padding
        only is masked out.
      scale: score scale, ``1/sqrt(Dk)`` by default.

    Returns:
      ``[L, Dv]`` in q's dtype.
    """
    name = "memory_compressed_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    C.check_same_length(name, x, "local blocks need self-attention (Lq == Lk)")
    wk, wv = jnp.asarray(wk), jnp.asarray(wv)
    if (wk.ndim != 3 or wv.ndim != 3 or wk.shape[0] != wv.shape[0]
            or wk.shape[1:] != (x.dk, x.dk) or wv.shape[1:] != (x.dv, x.dv)):
        raise ValueError(
            f"{name}: wk must be [c, Dk, Dk] = [c, {x.dk}, {x.dk}] and wv [c, Dv, Dv] = "
            f"[c, {x.dv}, {x.dv}] with the same c, but got wk{wk.shape}, wv{wv.shape}"
        )
    b = C.check_positive_int(name, "block_size", block_size)
    c = wk.shape[0]
    length = x.lq
    real = jnp.ones((length,), bool) if kv_mask is None else kv_mask
    kk = jnp.where(real[:, None], x.k, 0)
    vv = jnp.where(real[:, None], x.v, 0)
    mem_k = compress(kk, wk).astype(x.k.dtype)
    mem_v = compress(vv, wv).astype(x.v.dtype)
    n_mem = mem_k.shape[0]
    slot_real = jnp.pad(real, (0, -length % c)).reshape(n_mem, c).any(1)
    slot_end = jnp.arange(1, n_mem + 1) * c - 1

    pad = -length % b
    n_blocks = (length + pad) // b
    blocks = lambda a: jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(
        n_blocks, b, *a.shape[1:])
    qb, kb, vb = blocks(x.q), blocks(x.k), blocks(x.v)
    real_b = blocks(real)
    pos = jnp.arange(n_blocks * b).reshape(n_blocks, b)

    def one_block(qi, ki, vi, real_i, pos_i):
        local = jnp.broadcast_to(real_i[None, :], (b, b))
        memory = jnp.broadcast_to(slot_real[None, :], (b, n_mem))
        if causal:
            local = local & (pos_i[None, :] <= pos_i[:, None])
            memory = memory & (slot_end[None, :] <= pos_i[:, None])
        seen = jnp.concatenate([local, memory], axis=1)
        bias = jnp.where(seen, 0.0, -jnp.inf).astype(C.STATS_DTYPE)
        return dot_product_attention(qi, jnp.concatenate([ki, mem_k]),
                                     jnp.concatenate([vi, mem_v]), bias=bias, scale=scale)

    out = jax.vmap(one_block)(qb, kb, vb, real_b, pos)
    return out.reshape(-1, x.dv)[:length]
