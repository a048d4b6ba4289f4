"""Set Transformer blocks: MAB, SAB, ISAB (inducing points) and PMA (seed vectors).

Lee et al., 2019, "Set Transformer: A Framework for Attention-based Permutation-Invariant
Neural Networks"::

    MAB(X, Y) = LayerNorm(H + rFF(H)),  H = LayerNorm(X + Multihead(X, Y, Y))
    SAB(X) = MAB(X, X)    ISAB_m(X) = MAB(X, MAB(I_m, X))    PMA_k(X) = MAB(S_k, rFF(X))

Like the other ``xformers_jax.nn`` modules these are batched: a batch of sets ``x [B, N, dim]``
with an optional ``mask bool[B, N]`` marking real elements; padding never reaches a real output.
``Multihead`` is a :class:`~xformers_jax.nn.MultiHeadAttention` over any attention kind named
by ``spec`` (dense softmax attention by default).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..nn import AttentionSpec, FeedForward, LayerNorm, MultiHeadAttention


class MAB(eqx.Module):
    """Multihead attention block: ``x [B, Nx, dim]`` attends over ``y [B, Ny, dim]`` (over
    ``x`` itself when ``y`` is None: self attention).

    Args:
      dim: width. num_heads: attention heads (dividing ``dim``).
      spec: the attention kind (:class:`AttentionSpec`; dense ``dot_product`` by default).
      max_len: the longest set, for kinds with length-sized parameters. key: PRNG key.
    """

    attn: MultiHeadAttention
    ff: FeedForward
    norm1: LayerNorm
    norm2: LayerNorm

    def __init__(self, dim: int, num_heads: int, *, spec: AttentionSpec | None = None,
                 max_len: int = 512, key):
        if dim % num_heads:
            raise ValueError(f"MAB: dim={dim} must be a multiple of num_heads={num_heads}")
        ka, kf = jax.random.split(key)
        spec = AttentionSpec() if spec is None else spec
        self.attn = MultiHeadAttention(dim, num_heads, spec=spec, max_len=max_len, key=ka)
        self.ff = FeedForward(dim, dim, "relu", key=kf)
        self.norm1, self.norm2 = LayerNorm(dim), LayerNorm(dim)

    def __call__(self, x, y=None, *, mask=None):
        """x: ``[B, Nx, dim]``; y: ``[B, Ny, dim]`` or None; mask: ``bool[B, Ny]`` (real
        elements of ``y``). Returns ``[B, Nx, dim]``."""
        h = self.norm1(x + self.attn(x, y, kv_mask=mask))
        return self.norm2(h + self.ff(h))


class SAB(eqx.Module):
    """Set attention block ``MAB(X, X)``: permutation equivariant, ``O(N^2)``."""

    mab: MAB

    def __init__(self, dim: int, num_heads: int, *, spec: AttentionSpec | None = None,
                 max_len: int = 512, key):
        self.mab = MAB(dim, num_heads, spec=spec, max_len=max_len, key=key)

    def __call__(self, x, *, mask=None):
        """x: ``[B, N, dim]``; mask: ``bool[B, N]``. Returns ``[B, N, dim]``."""
        return self.mab(x, mask=mask)


def _broadcast(a, x):
    """A learned ``[k, dim]`` array repeated over the batch of ``x`` in x's dtype."""
    return jnp.broadcast_to(a.astype(x.dtype), (x.shape[0], *a.shape))


class ISAB(eqx.Module):
    """Induced set attention block ``MAB(X, MAB(I, X))`` with ``m`` learned inducing points:
    permutation equivariant, ``O(N m)``."""

    inducing: jax.Array
    mab_in: MAB
    mab_out: MAB

    def __init__(self, dim: int, num_heads: int, num_inducing: int, *,
                 spec: AttentionSpec | None = None, max_len: int = 512, key):
        ki, k1, k2 = jax.random.split(key, 3)
        self.inducing = dim ** -0.5 * jax.random.normal(ki, (num_inducing, dim))
        self.mab_in = MAB(dim, num_heads, spec=spec, max_len=max_len, key=k1)
        self.mab_out = MAB(dim, num_heads, spec=spec, max_len=max_len, key=k2)

    def __call__(self, x, *, mask=None):
        """x: ``[B, N, dim]``; mask: ``bool[B, N]``. Returns ``[B, N, dim]``."""
        summary = self.mab_in(_broadcast(self.inducing, x), x, mask=mask)
        return self.mab_out(x, summary)


class PMA(eqx.Module):
    """Pooling by multihead attention ``MAB(S, rFF(X))`` with ``k`` learned seed vectors:
    ``[B, N, dim] -> [B, k, dim]``, permutation invariant."""

    seeds: jax.Array
    ff: FeedForward
    mab: MAB

    def __init__(self, dim: int, num_heads: int, num_seeds: int = 1, *,
                 spec: AttentionSpec | None = None, max_len: int = 512, key):
        ks, kf, km = jax.random.split(key, 3)
        self.seeds = dim ** -0.5 * jax.random.normal(ks, (num_seeds, dim))
        self.ff = FeedForward(dim, dim, "relu", key=kf)
        self.mab = MAB(dim, num_heads, spec=spec, max_len=max_len, key=km)

    def __call__(self, x, *, mask=None):
        """x: ``[B, N, dim]``; mask: ``bool[B, N]``. Returns ``[B, num_seeds, dim]``."""
        return self.mab(_broadcast(self.seeds, x), self.ff(x), mask=mask)
