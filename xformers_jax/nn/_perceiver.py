"""Perceiver (a latent array cross-attends to the input) and Perceiver AR (its causal form).

Jaegle et al., "Perceiver: General Perception with Iterative Attention" (2021); survey T2
Table 1 (``O(kN)``, down-sampling + memory). A small learned latent array ``[M, dim]`` reads a
long input ``[N, input_dim]`` through one cross-attention (cost ``O(M N)``), then runs ordinary
self-attention blocks on the latents only (``O(M^2)`` each), so depth no longer multiplies the
input length.

Hawthorne et al., "General-purpose, long-context autoregressive modeling with Perceiver AR"
(2022): the latents are the *last* ``M`` positions of the input itself. Latent i sits at input
position ``p_i = N - M + i`` and its cross-attention sees inputs ``j <= p_i``; the latent
self-attention is causal, so the output for position ``p_i`` depends on no later input and
predicts token ``p_i + 1``.

Both modules take one sequence (vmap for a batch) and an optional ``mask bool[N]`` marking real
inputs; padding never reaches a real output. Blocks are pre-norm residual (as in the papers):
``h = x + Attn(LN(x), LN(y)); h = h + MLP(LN(h))``. The attention itself is
:func:`~xformers_jax.attention.flash_attention`, so no ``[M, N]`` matrix is stored.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..attention import flash_attention
from ..attention.patterns import Local

from ._ffn import FeedForward


class _Attention(eqx.Module):
    """Multi-head attention of ``x [Lq, q_dim]`` over ``y [Lk, kv_dim]`` (output ``q_dim``)."""

    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)

    def __init__(self, q_dim: int, kv_dim: int, num_heads: int, *, key):
        if q_dim % num_heads:
            raise ValueError(f"Perceiver: width {q_dim} must be a multiple of num_heads="
                             f"{num_heads}")
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q_proj = eqx.nn.Linear(q_dim, q_dim, key=kq)
        self.k_proj = eqx.nn.Linear(kv_dim, q_dim, key=kk)
        self.v_proj = eqx.nn.Linear(kv_dim, q_dim, key=kv)
        self.o_proj = eqx.nn.Linear(q_dim, q_dim, key=ko)
        self.num_heads = num_heads

    def __call__(self, x, y, *, kv_mask=None, offset: int | None = None):
        """``offset=None``: every query sees every key. ``offset=o``: query i sees keys
        ``j <= i + o`` (queries are the keys' last positions when ``o = Lk - Lq``)."""
        heads = lambda a: a.reshape(a.shape[0], self.num_heads, -1)
        q = heads(jax.vmap(self.q_proj)(x))
        k, v = heads(jax.vmap(self.k_proj)(y)), heads(jax.vmap(self.v_proj)(y))
        # Local(Lk, o) is the band j >= i - Lk (always true) and j <= i + o: the offset causal
        # mask, as a static pattern so flash attention skips the tiles above it.
        pattern = None if offset is None else Local(y.shape[0], offset)
        att = jax.vmap(lambda q, k, v: flash_attention(q, k, v, kv_mask=kv_mask, pattern=pattern),
                       in_axes=1, out_axes=1)(q, k, v)
        return jax.vmap(self.o_proj)(att.reshape(x.shape[0], -1))


class _Block(eqx.Module):
    """Pre-norm attention plus MLP. ``x`` attends over ``y`` (default ``x``); a block made with
    ``kv_dim`` normalises ``y`` with its own norm (cross-attention to another array), otherwise
    ``y`` shares the queries' norm (``y`` is the same sequence, or a superset of it)."""

    attention: _Attention
    norm_q: eqx.nn.LayerNorm
    norm_kv: eqx.nn.LayerNorm | None
    norm_ff: eqx.nn.LayerNorm
    ff: FeedForward

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int, *, kv_dim: int | None = None,
                 key):
        ka, kf = jax.random.split(key)
        self.attention = _Attention(dim, kv_dim or dim, num_heads, key=ka)
        self.norm_q = eqx.nn.LayerNorm(dim)
        self.norm_kv = None if kv_dim is None else eqx.nn.LayerNorm(kv_dim)
        self.norm_ff = eqx.nn.LayerNorm(dim)
        self.ff = FeedForward(dim, mlp_ratio * dim, "gelu", key=kf)

    def __call__(self, x, y=None, *, kv_mask=None, offset=None):
        xn = jax.vmap(self.norm_q)(x)
        yn = (xn if y is None else
              jax.vmap(self.norm_q if self.norm_kv is None else self.norm_kv)(y))
        h = x + self.attention(xn, yn, kv_mask=kv_mask, offset=offset)
        return h + self.ff(jax.vmap(self.norm_ff)(h)[None])[0]


class PerceiverEncoder(eqx.Module):
    """Perceiver encoder: ``x [N, input_dim] -> latents [num_latents, latent_dim]``.

    A learned latent array cross-attends to the input (keys where ``mask`` is False are
    ignored), then ``num_layers`` latent self-attention blocks follow. Without positional
    features in ``x`` the output is invariant to permuting the input (it is a set encoder);
    add positions to ``x`` for sequences or images, as the paper does with Fourier features.

    Args:
      input_dim: width of the input. latent_dim: width of the latents.
      num_latents: ``M``, the latent array's length (cost ``O(M N)`` for the cross-attention).
      num_layers: latent self-attention blocks after the cross-attention.
      num_heads: heads of the latent self-attention. cross_heads: heads of the cross-attention
        (the paper uses one).
      mlp_ratio: MLP hidden width over ``latent_dim``.
    """

    latents: jax.Array
    cross: _Block
    layers: tuple[_Block, ...]

    def __init__(self, input_dim: int, latent_dim: int, num_latents: int, num_layers: int,
                 num_heads: int, *, cross_heads: int = 1, mlp_ratio: int = 4, key):
        kl, kc, *ks = jax.random.split(key, 2 + num_layers)
        self.latents = latent_dim ** -0.5 * jax.random.normal(kl, (num_latents, latent_dim))
        self.cross = _Block(latent_dim, cross_heads, mlp_ratio, kv_dim=input_dim, key=kc)
        self.layers = tuple(_Block(latent_dim, num_heads, mlp_ratio, key=k) for k in ks)

    def __call__(self, x, *, mask=None):
        """x: ``[N, input_dim]``; mask: ``bool[N]``, True for real inputs -> ``[M, latent_dim]``."""
        if x.ndim != 2 or x.shape[1] != self.cross.norm_kv.shape[0]:
            raise ValueError(f"PerceiverEncoder: x must be [N, input_dim="
                             f"{self.cross.norm_kv.shape[0]}] but got {x.shape}")
        h = self.cross(self.latents.astype(x.dtype), x, kv_mask=mask)
        for layer in self.layers:
            h = layer(h)
        return h


class PerceiverAR(eqx.Module):
    """Perceiver AR: ``x [N, dim] -> [num_latents, dim]``, the outputs at the last
    ``num_latents`` positions, causal.

    Latent i is initialised from ``x[N - M + i]`` and cross-attends to ``x[j]`` for ``j <= N - M
    + i``; the ``num_layers`` latent self-attention blocks are causal. So output i depends on
    ``x[:N - M + i + 1]`` only and can be trained to predict token ``N - M + i + 1``. Positions
    must be in ``x`` already (the paper uses rotary embeddings). ``mask`` marks real inputs
    (e.g. left padding of a short prompt).

    Args:
      dim: model width. num_latents: ``M``, how many trailing positions get an output.
      num_layers: causal latent self-attention blocks after the cross-attention.
      num_heads: heads of every attention. mlp_ratio: MLP hidden width over ``dim``.
    """

    cross: _Block
    layers: tuple[_Block, ...]
    num_latents: int = eqx.field(static=True)

    def __init__(self, dim: int, num_latents: int, num_layers: int, num_heads: int, *,
                 mlp_ratio: int = 4, key):
        kc, *ks = jax.random.split(key, 1 + num_layers)
        self.cross = _Block(dim, num_heads, mlp_ratio, key=kc)
        self.layers = tuple(_Block(dim, num_heads, mlp_ratio, key=k) for k in ks)
        self.num_latents = num_latents

    def __call__(self, x, *, mask=None):
        """x: ``[N, dim]`` with ``N >= num_latents``; mask: ``bool[N]`` -> ``[M, dim]``."""
        m = self.num_latents
        dim = self.cross.norm_q.shape[0]
        if x.ndim != 2 or x.shape[1] != dim or x.shape[0] < m:
            raise ValueError(f"PerceiverAR: x must be [N >= num_latents={m}, dim={dim}] but "
                             f"got {x.shape}")
        n = x.shape[0]
        h = self.cross(x[n - m:], x, kv_mask=mask, offset=n - m)
        latent_mask = None if mask is None else mask[n - m:]
        for layer in self.layers:
            h = layer(h, kv_mask=latent_mask, offset=0)
        return h
