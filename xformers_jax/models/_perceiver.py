"""Perceiver (a latent array cross-attends to the input) and Perceiver AR (its causal form).

Jaegle et al., 2021, "Perceiver: General Perception with Iterative Attention": a small learned
latent array ``[M, dim]`` reads a long input ``[N, input_dim]`` through one cross-attention
(cost ``O(M N)``), then runs ordinary self-attention blocks on the latents only (``O(M^2)``
each), so depth no longer multiplies the input length.

Hawthorne et al., 2022, "General-purpose, long-context autoregressive modeling with Perceiver
AR": the latents are the *last* ``M`` positions of the input itself. Latent i sits at input
position ``p_i = N - M + i`` and its cross-attention sees inputs ``j <= p_i``; the latent
self-attention is causal, so the output for position ``p_i`` depends on no later input and
predicts token ``p_i + 1``.

Like the other ``xformers_jax.nn`` modules both are batched, ``x [B, N, ...]`` with an optional
``mask bool[B, N]`` marking real inputs; padding never reaches a real output. Blocks are
pre-norm residual (as in the papers): ``h = x + Attn(LN(x), LN(y)); h = h + MLP(LN(h))``, with
``Attn`` a :class:`~xformers_jax.nn.MultiHeadAttention` over the kind ``spec`` names (flash
attention by default, so no ``[M, N]`` matrix is stored).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import axes as X
from ..attention.patterns import Pattern
from ..nn import AttentionSpec, FeedForward, LayerNorm, MultiHeadAttention


@dataclasses.dataclass(frozen=True)
class _SuffixCausal(Pattern):
    """Causal attention of queries that are the last ``lq`` of the ``lk`` key positions: query
    i sits at position ``i + lk - lq`` and sees keys ``j <= i + lk - lq`` (Perceiver AR's
    cross-attention). Shape-free, so one spec serves every input length."""

    causal_safe = True

    def mask(self, i, j, lq, lk):
        return j <= i + (lk - lq)

    def block_kinds(self, lq, lk, block_q, block_k):
        r0, r1, c0, c1 = Pattern.tile_bounds(lq, lk, block_q, block_k)
        return Pattern.tile_kinds(c1 <= r0 + (lk - lq), c0 > r1 + (lk - lq))


def _with_pattern(spec: AttentionSpec, pattern: Pattern) -> AttentionSpec:
    """``spec`` whose static pattern is also restricted to ``pattern``."""
    hp = spec.hyperparameters
    hp["pattern"] = pattern if hp.get("pattern") is None else hp["pattern"] & pattern
    return AttentionSpec(spec.kind, hp)


class _Block(eqx.Module):
    """Pre-norm attention plus MLP. ``x`` attends over ``y`` (self attention when ``y`` is
    None); a block made with ``kv_dim`` normalises ``y`` with its own norm (cross-attention to
    another array), otherwise ``y`` shares the queries' norm (``y`` is the same sequence, or a
    superset of it)."""

    attn: MultiHeadAttention
    norm_q: LayerNorm
    norm_kv: LayerNorm | None
    norm_ff: LayerNorm
    ff: FeedForward

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int, *, spec: AttentionSpec,
                 kv_dim: int | None = None, causal: bool = False, max_len: int = 512, key):
        if dim % num_heads:
            raise ValueError(f"Perceiver: width {dim} must be a multiple of num_heads="
                             f"{num_heads}")
        ka, kf = jax.random.split(key)
        self.attn = MultiHeadAttention(dim, num_heads, spec=spec, kv_dim=kv_dim, causal=causal,
                                       max_len=max_len, key=ka)
        self.norm_q = LayerNorm(dim)
        self.norm_kv = None if kv_dim is None else LayerNorm(kv_dim)
        self.norm_ff = LayerNorm(dim)
        self.ff = FeedForward(dim, mlp_ratio * dim, "gelu", key=kf)

    def __call__(self, x, y=None, *, kv_mask=None):
        xn = self.norm_q(x)
        yn = None if y is None else (self.norm_q if self.norm_kv is None else self.norm_kv)(y)
        h = x + self.attn(xn, yn, kv_mask=kv_mask)
        return h + self.ff(self.norm_ff(h))


class PerceiverEncoder(eqx.Module):
    """Perceiver encoder: ``x [B, N, input_dim] -> latents [B, num_latents, latent_dim]``.

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
      spec: the attention kind of every attention (:class:`AttentionSpec`; flash attention by
        default). max_len: the longest input, for kinds with length-sized parameters.
    """

    latents: jax.Array = X.param(None, X.EMBED)
    cross: _Block
    layers: tuple[_Block, ...]

    def __init__(self, input_dim: int, latent_dim: int, num_latents: int, num_layers: int,
                 num_heads: int, *, cross_heads: int = 1, mlp_ratio: int = 4,
                 spec: AttentionSpec | None = None, max_len: int = 512, key):
        kl, kc, *ks = jax.random.split(key, 2 + num_layers)
        spec = AttentionSpec("flash") if spec is None else spec
        self.latents = latent_dim ** -0.5 * jax.random.normal(kl, (num_latents, latent_dim))
        self.cross = _Block(latent_dim, cross_heads, mlp_ratio, spec=spec, kv_dim=input_dim,
                            max_len=max_len, key=kc)
        self.layers = tuple(_Block(latent_dim, num_heads, mlp_ratio, spec=spec, max_len=max_len,
                                   key=k) for k in ks)

    def __call__(self, x, *, mask=None):
        """x: ``[B, N, input_dim]``; mask: ``bool[B, N]``, True for real inputs ->
        ``[B, M, latent_dim]``."""
        input_dim = self.cross.norm_kv.weight.shape[0]
        if x.ndim != 3 or x.shape[2] != input_dim:
            raise ValueError(f"PerceiverEncoder: x must be [B, N, input_dim={input_dim}] but got "
                             f"{x.shape}")
        latents = jnp.broadcast_to(self.latents.astype(x.dtype), (x.shape[0],
                                                                  *self.latents.shape))
        h = self.cross(latents, x, kv_mask=mask)
        for layer in self.layers:
            h = layer(h)
        return h


class PerceiverAR(eqx.Module):
    """Perceiver AR: ``x [B, N, dim] -> [B, num_latents, dim]``, the outputs at the last
    ``num_latents`` positions, causal.

    Latent i is initialised from ``x[:, N - M + i]`` and cross-attends to ``x[:, j]`` for
    ``j <= N - M + i``; the ``num_layers`` latent self-attention blocks are causal. So output i
    depends on ``x[:, :N - M + i + 1]`` only and can be trained to predict token
    ``N - M + i + 1``. Positions must be in ``x`` already (the paper uses rotary embeddings).
    ``mask`` marks real inputs (e.g. left padding of a short prompt).

    Args:
      dim: model width. num_latents: ``M``, how many trailing positions get an output.
      num_layers: causal latent self-attention blocks after the cross-attention.
      num_heads: heads of every attention. mlp_ratio: MLP hidden width over ``dim``.
      spec: the attention kind of every attention (:class:`AttentionSpec`; flash attention by
        default). The cross-attention adds a static pattern to it, so its kind must accept a
        ``pattern`` hyperparameter; the latent blocks are causal, so it must support causal.
        max_len: the longest input, for kinds with length-sized parameters.
    """

    cross: _Block
    layers: tuple[_Block, ...]
    num_latents: int = eqx.field(static=True)

    def __init__(self, dim: int, num_latents: int, num_layers: int, num_heads: int, *,
                 mlp_ratio: int = 4, spec: AttentionSpec | None = None,
                 max_len: int = 512, key):
        kc, *ks = jax.random.split(key, 1 + num_layers)
        spec = AttentionSpec("flash") if spec is None else spec
        # The latents are the input's last positions: the cross-attention is causal with the
        # queries aligned to the end of the keys (a static pattern, so exact kernels skip the
        # tiles above it).
        self.cross = _Block(dim, num_heads, mlp_ratio, spec=_with_pattern(spec, _SuffixCausal()),
                            max_len=max_len, key=kc)
        self.layers = tuple(_Block(dim, num_heads, mlp_ratio, spec=spec, causal=True,
                                   max_len=max_len, key=k) for k in ks)
        self.num_latents = num_latents

    def __call__(self, x, *, mask=None):
        """x: ``[B, N, dim]`` with ``N >= num_latents``; mask: ``bool[B, N]`` ->
        ``[B, M, dim]``."""
        m = self.num_latents
        dim = self.cross.norm_q.weight.shape[0]
        if x.ndim != 3 or x.shape[2] != dim or x.shape[1] < m:
            raise ValueError(f"PerceiverAR: x must be [B, N >= num_latents={m}, dim={dim}] but "
                             f"got {x.shape}")
        n = x.shape[1]
        h = self.cross(x[:, n - m:], x, kv_mask=mask)
        latent_mask = None if mask is None else mask[:, n - m:]
        for layer in self.layers:
            h = layer(h, kv_mask=latent_mask)
        return h
