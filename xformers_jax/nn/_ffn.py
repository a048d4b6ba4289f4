"""Position-wise feed-forward networks (Vaswani et al., 2017): ReLU, GELU, Swish and GLU variants
(GLU, GEGLU, SwiGLU; Shazeer, 2020) over ``xformers_jax.experts.feed_forward``, optionally
applied in chunks of positions so the hidden ``[L, hidden]`` activation is never held for the
whole sequence (Reformer's chunked FFN). The FFN kind ``"dense"``."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import axes as X
from ..experts import FFN_ACTIVATIONS, GATED, feed_forward
from ._slots import implements


@implements("dense")
class FeedForward(eqx.Module):
    """``act(x W1 [+ b1]) W2`` or, for gated kinds, ``(act(x W1) * (x V)) W2``.

    Args:
      dim: model width. hidden: inner width. activation: one of ``experts.FFN_ACTIVATIONS``.
      chunk_size: if set, positions are processed ``chunk_size`` at a time with ``lax.map``
        (same result; peak activation memory proportional to the chunk).
      causal: accepted for the FFN slot's call (``FFNSpec.build``); a position-wise FFN is
        causal-safe either way.
    """

    w1: jax.Array = X.param(X.EMBED, X.MLP)
    w_gate: jax.Array | None = X.param(X.EMBED, X.MLP)
    w2: jax.Array = X.param(X.MLP, X.EMBED)
    b1: jax.Array = X.param(X.MLP)
    b2: jax.Array = X.param(X.EMBED)
    activation: str = eqx.field(static=True)
    chunk_size: int | None = eqx.field(static=True)

    def __init__(self, dim: int, hidden: int, activation: str = "gelu", *,
                 chunk_size: int | None = None, causal: bool = False, key):
        del causal
        if activation not in FFN_ACTIVATIONS:
            raise ValueError(f"FeedForward: unknown activation {activation!r}; choose one of "
                             f"{sorted(FFN_ACTIVATIONS)}")
        k1, k2, k3 = jax.random.split(key, 3)
        self.w1 = jax.random.normal(k1, (dim, hidden)) / math.sqrt(dim)
        self.w_gate = (jax.random.normal(k3, (dim, hidden)) / math.sqrt(dim)
                       if activation in GATED else None)
        self.w2 = jax.random.normal(k2, (hidden, dim)) / math.sqrt(hidden)
        self.b1, self.b2 = jnp.zeros((hidden,)), jnp.zeros((dim,))
        self.activation, self.chunk_size = activation, chunk_size

    def _apply(self, x):
        return feed_forward(x, self.w1, self.b1, self.w2, self.b2, self.w_gate,
                            activation=self.activation)

    def __call__(self, x):
        """x: ``[B, L, dim]`` -> ``[B, L, dim]``."""
        if self.chunk_size is None or x.shape[1] <= self.chunk_size:
            return self._apply(x)
        b, length, d = x.shape
        n = -(-length // self.chunk_size)
        xp = jnp.pad(x, ((0, 0), (0, n * self.chunk_size - length), (0, 0)))
        chunks = jnp.moveaxis(xp.reshape(b, n, self.chunk_size, d), 1, 0)
        out = jax.lax.map(self._apply, chunks)
        return jnp.moveaxis(out, 0, 1).reshape(b, -1, d)[:, :length]
