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
    """Keys ``[B, C, Hkv, Dk]``, values ``[B, C, Hkv, Dv]``, positions ``int32[C]`` (-1 when
    empty) and the next position ``index``; ``ring`` says whether old entries may be evicted."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    index: jax.Array
    ring: bool = eqx.field(static=True)

    @classmethod
    def empty(cls, batch, capacity, kv_heads, dk, dv, dtype, *, ring: bool):
        return cls(
            jnp.zeros((batch, capacity, kv_heads, dk), dtype),
            jnp.zeros((batch, capacity, kv_heads, dv), dtype),
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
        k = jax.lax.dynamic_update_slice_in_dim(self.k, k_t.astype(self.k.dtype), slot, axis=1)
        v = jax.lax.dynamic_update_slice_in_dim(self.v, v_t.astype(self.v.dtype), slot, axis=1)
        return KVCache(k, v, self.pos.at[slot].set(t), t + 1, self.ring)

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
