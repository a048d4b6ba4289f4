"""Decoding caches: a key/value cache (ring-buffered for sliding windows) and a recurrent state.

A :class:`KVCache` with capacity ``C`` stores keys and values at slot ``t % C`` together with
their absolute positions. With ``C = max_len`` it is the usual KV cache; with
``C = window + 1`` old entries are evicted as the window slides (local attention decodes in
``O(window)`` memory). A :class:`RecurrentCache` holds a linear-attention state (e.g.
``S = sum phi(k) v^T``, ``z = sum phi(k)``), whose size does not grow with the sequence.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp


class KVCache(eqx.Module):
    """Keys ``[B, Hkv, C, Dk]``, values ``[B, Hkv, C, Dv]``, positions ``int32[C]`` (-1 when
    empty) and the next position ``index``; ``ring`` says whether old entries may be evicted.

    Heads come before the slots so that each key/value head's ``[C, D]`` block is contiguous:
    a one-query decoding step reads it as one matrix (a matrix-vector product per head, see
    ``attention.decode_attention``) instead of gathering ``C`` strided rows; :meth:`keys` and
    :meth:`values` give the ``[B, C, Hkv, D]`` layout of the attention functions (a copy)."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    index: jax.Array
    ring: bool = eqx.field(static=True)

    @classmethod
    def empty(cls, batch, capacity, kv_heads, dk, dv, dtype, *, ring: bool):
        return cls(
            jnp.zeros((batch, kv_heads, capacity, dk), dtype),
            jnp.zeros((batch, kv_heads, capacity, dv), dtype),
            jnp.full((capacity,), -1, jnp.int32),
            jnp.zeros((), jnp.int32),
            ring,
        )

    def append(self, k_t, v_t) -> "KVCache":
        """Writes one step ``k_t: [B, 1, Hkv, Dk]``, ``v_t: [B, 1, Hkv, Dv]`` at ``index``."""
        capacity = self.pos.shape[0]
        t = self.index
        if not self.ring:
            t = eqx.error_if(t, t >= capacity,
                             f"KVCache: decoding past the cache capacity ({capacity})")
        slot = t % capacity
        k_t, v_t = jnp.swapaxes(k_t, 1, 2), jnp.swapaxes(v_t, 1, 2)  # [B, Hkv, 1, D]
        k = jax.lax.dynamic_update_slice_in_dim(self.k, k_t.astype(self.k.dtype), slot, axis=2)
        v = jax.lax.dynamic_update_slice_in_dim(self.v, v_t.astype(self.v.dtype), slot, axis=2)
        return KVCache(k, v, self.pos.at[slot].set(t), t + 1, self.ring)

    def keys(self):
        """Keys as ``[B, C, Hkv, Dk]`` (the attention functions' layout; a copy)."""
        return jnp.swapaxes(self.k, 1, 2)

    def values(self):
        """Values as ``[B, C, Hkv, Dv]`` (a copy)."""
        return jnp.swapaxes(self.v, 1, 2)

    @property
    def valid(self):
        """``bool[C]``: slots holding a key."""
        return self.pos >= 0


class RecurrentCache(eqx.Module):
    """A linear-attention recurrent state (any pytree) and the next position ``index``."""

    state: Any
    index: jax.Array


class BlockCache(eqx.Module):
    """A block's decoding state when its FFN keeps one: the mixer's or attention's cache
    (``attn``) and the FFN's (``ffn``, e.g. the per-row expert counts of capacity routing,
    ``experts.CapacityState``). A block whose FFN keeps none decodes with the ``attn`` cache
    alone."""

    attn: Any
    ffn: Any


class PagedKVCache(eqx.Module):
    """One sequence's view of a paged key/value cache (Kwon et al., 2023, "Efficient Memory
    Management for Large Language Model Serving with PagedAttention"), for one layer.

    Keys and values live in a pool of fixed-size pages shared by every sequence, ``k_pages:
    [N, P, Hkv, Dk]``, ``v_pages: [N, P, Hkv, Dv]``; the sequence's ``table: int[M]`` lists the
    page holding its positions ``j P .. j P + P - 1`` at entry ``j`` (any page where the entry
    is unused: positions at or past ``length`` and, for a window, those out of it are masked,
    so such a page's contents, NaN included, are never read). ``length`` (int) is the number of
    tokens already held, the position of the next one.

    A decoding step reads the sequence's pages where they lie in the pool (those from its
    window's first to its length, a few pages at a time; a score bias's general path gathers
    them, :meth:`gather`) and returns the step's key and value as ``new_k: [1, Hkv, Dk]`` and
    ``new_v``; it does not write them: the caller (``models.Server``) scatters
    every sequence's new entries into their pages after the step, so that sequences decoded
    side by side (``jax.vmap`` over sequences, the pool shared) never copy the pool.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    table: jax.Array
    length: jax.Array
    new_k: jax.Array
    new_v: jax.Array

    @property
    def index(self):
        """The position of the token being decoded (the number held)."""
        return self.length

    def gather(self):
        """The sequence's pages in order: keys ``[1, M P, Hkv, Dk]``, values ``[1, M P, Hkv,
        Dv]`` and their positions ``int[M P]``."""
        m, p = self.table.shape[0], self.k_pages.shape[1]
        k = self.k_pages[self.table].reshape(1, m * p, *self.k_pages.shape[2:])
        v = self.v_pages[self.table].reshape(1, m * p, *self.v_pages.shape[2:])
        return k, v, jnp.arange(m * p, dtype=jnp.int32)
