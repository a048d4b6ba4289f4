"""Attention layers beside :class:`~xformers_jax.nn.MultiHeadAttention`, used on their own
rather than built by a block's attention slot.

* :class:`AllAttention`: Sukhbaatar et al. (2019), "Augmenting Self-attention with Persistent
  Memory": persistent key/value vectors concatenated to the context's; a block of
  all-attention drops its FFN (``ffn=FFNSpec("none")``, ``nn.NoFeedForward``).
* :class:`SparseQKVAttention`: Scaling Transformers' sparse QKV (Jaszczur et al., 2021): the
  Q, K, V projections as a multiplicative layer and convolutions (``experts.sparse_qkv``).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import attention as A
from .. import axes as X
from .. import experts as M


class AllAttention(eqx.Module):
    """All-attention layer (Sukhbaatar et al., 2019, "Augmenting Self-attention with Persistent
    Memory"): multi-head self-attention whose keys and values are the context's concatenated
    with ``num_persistent`` learned persistent vectors per head; the persistent vectors play the
    FFN's role, so a block of all-attention has no FFN (use ``ffn=FFNSpec("none")``). The
    persistent keys are visible from every position (causal masking applies to the context
    keys only) and are not position-encoded.

    Call: ``x [B, L, dim]``, ``kv_mask bool[B, L]`` (False for padding) -> ``[B, L, dim]``.
    """

    wq: jax.Array = X.param(X.EMBED, X.HEADS, X.KV)
    wk: jax.Array = X.param(X.EMBED, X.HEADS, X.KV)
    wv: jax.Array = X.param(X.EMBED, X.HEADS, X.KV)
    wo: jax.Array = X.param(X.HEADS, X.KV, X.EMBED)
    persistent_k: jax.Array = X.param(X.HEADS, None, X.KV)
    persistent_v: jax.Array = X.param(X.HEADS, None, X.KV)
    causal: bool = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, num_persistent: int = 16, *,
                 causal: bool = False, key):
        if dim % num_heads:
            raise ValueError(f"AllAttention: dim={dim} is not divisible by "
                             f"num_heads={num_heads}")
        dh = dim // num_heads
        ks = jax.random.split(key, 6)
        init = lambda k, s, fan: jax.random.normal(k, s) / math.sqrt(fan)  # noqa: E731
        self.wq, self.wk, self.wv = (init(k, (dim, num_heads, dh), dim) for k in ks[:3])
        self.wo = init(ks[3], (num_heads, dh, dim), dim)
        # The paper scales persistent keys/values to the context's (sqrt(dh), sqrt(N)); a
        # unit-variance key and value per head is the equivalent starting point here.
        self.persistent_k = jax.random.normal(ks[4], (num_heads, num_persistent, dh))
        self.persistent_v = jax.random.normal(ks[5], (num_heads, num_persistent, dh))
        self.causal = causal

    def __call__(self, x, *, kv_mask=None):
        b, length, _ = x.shape
        dt = x.dtype
        q, k, v = (jnp.einsum("bld,dhk->bhlk", x, w.astype(dt)) for w in (self.wq, self.wk,
                                                                           self.wv))
        scale = 1.0 / math.sqrt(q.shape[-1])
        s_ctx = jnp.einsum("bhqk,bhjk->bhqj", q, k).astype(jnp.float32) * scale
        allowed = jnp.ones((length, length), bool)
        if self.causal:
            allowed = jnp.tril(allowed)
        allowed = allowed[None, None]
        if kv_mask is not None:
            allowed = allowed & kv_mask[:, None, None, :]
        s_ctx = jnp.where(allowed, s_ctx, -jnp.inf)
        s_mem = jnp.einsum("bhqk,hnk->bhqn", q, self.persistent_k.astype(dt)).astype(
            jnp.float32) * scale
        p = jax.nn.softmax(jnp.concatenate([s_ctx, s_mem], -1), axis=-1).astype(dt)
        out = (jnp.einsum("bhqj,bhjk->bhqk", p[..., :length], v)
               + jnp.einsum("bhqn,hnk->bhqk", p[..., length:], self.persistent_v.astype(dt)))
        return jnp.einsum("bhlk,hkd->bld", out, self.wo.astype(dt))


class SparseQKVAttention(eqx.Module):
    """Multi-head softmax attention whose Q, K, V come from Scaling Transformers' sparse QKV
    (Jaszczur et al., 2021; ``experts.sparse_qkv``: a shared multiplicative layer over ``S``
    modules, then a causal-in-length convolution per projection) instead of three dense
    projections; a dense output projection. A standalone layer (the block's attention slot
    does not build it).

    Args: dim, num_heads, ``modules`` (``S``, dividing ``dim``; default ``num_heads``, as in
    the paper), ``length_kernel`` (``F_len``), causal. Call: ``x [B, L, dim]``, ``kv_mask
    bool[B, L]`` -> ``[B, L, dim]``.
    """

    d_mult: jax.Array = X.param(X.EMBED, None)
    e_mult: jax.Array = X.param(X.EMBED, None)
    b_mult: jax.Array
    kernels: tuple
    biases: tuple
    wo: jax.Array = X.param(X.EMBED, X.EMBED)
    num_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, *, modules: int | None = None,
                 length_kernel: int = 3, causal: bool = False, key):
        s = num_heads if modules is None else modules
        if dim % s or dim % num_heads:
            raise ValueError(f"SparseQKVAttention: dim={dim} must split into {s} modules and "
                             f"{num_heads} heads")
        m = dim // s
        ks = jax.random.split(key, 6)
        # trax's initialisation: the module multipliers ~ N(0, 0.5), the shared kernel Glorot.
        self.d_mult = 0.5 * jax.random.normal(ks[0], (dim, s))
        self.e_mult = jax.random.normal(ks[1], (dim, m)) * math.sqrt(2.0 / (dim + m))
        self.b_mult = jnp.zeros((s, m))
        self.kernels = tuple(
            jax.random.normal(k, (length_kernel, f, m, m)) / math.sqrt(length_kernel * f * m)
            for k, f in zip(ks[2:5], (3, 3, 1)))
        self.biases = tuple(jnp.zeros((m,)) for _ in range(3))
        self.wo = jax.random.normal(ks[5], (dim, dim)) / math.sqrt(dim)
        self.num_heads, self.causal = num_heads, causal

    def qkv(self, x, *, kv_mask=None):
        """``(q, k, v)``, each ``[B, L, num_heads, dim / num_heads]``."""
        b, length, d = x.shape
        q, k, v = M.sparse_qkv(x, self.d_mult, self.e_mult, self.b_mult, self.kernels,
                               self.biases, mask=kv_mask)
        return tuple(a.reshape(b, length, self.num_heads, -1) for a in (q, k, v))

    def __call__(self, x, *, kv_mask=None):
        q, k, v = self.qkv(x, kv_mask=kv_mask)
        o = A.multihead(A.dot_product_attention)(q, k, v, causal=self.causal, kv_mask=kv_mask)
        return o.reshape(x.shape) @ self.wo.astype(x.dtype)
