"""Normalisation layers over the last axis (Ba et al., 2016; Lin et al., 2022, "A Survey of
Transformers", section 5.2).

Every norm takes ``x: [B, L, D]`` and computes its statistics in float32, returning x's dtype.
As with Equinox's norms, state appears only where there is some: a stateless :class:`Norm` is
called as ``norm(x) -> y``; a :class:`StatefulNorm` (:class:`PowerNorm`, whose running
statistics live in an ``eqx.nn.State``) as ``norm(x, state, *, mask, inference) -> (y, state)``.
"""

from __future__ import annotations

import abc
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

_EPS = 1e-6


class Norm(eqx.Module):
    """Abstract base of the norms. A stateless norm is ``norm(x [B, L, D]) -> y [B, L, D]``;
    stateful ones subclass :class:`StatefulNorm`."""

    @abc.abstractmethod
    def __call__(self, x: Float[Array, "batch length dim"]) -> Float[Array, "batch length dim"]:
        raise NotImplementedError


class StatefulNorm(Norm):
    """Abstract base of norms with running statistics in an ``eqx.nn.State`` (build the model
    with ``eqx.nn.make_with_state``): ``norm(x, state, *, mask=None, inference=False) ->
    (y, state)``. ``mask bool[B, L]`` leaves padded tokens out of the statistics; inference
    uses them without updating."""

    @abc.abstractmethod
    def __call__(self, x: Float[Array, "batch length dim"], state: eqx.nn.State, *,
                 mask: Bool[Array, "batch length"] | None = None, inference: bool = False):
        raise NotImplementedError


@final
class LayerNorm(Norm):
    """Layer normalisation with a learned gain and bias (Ba et al., 2016)."""

    weight: jax.Array
    bias: jax.Array

    def __init__(self, dim: int):
        self.weight, self.bias = jnp.ones((dim,)), jnp.zeros((dim,))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = (x32 - x32.mean(-1, keepdims=True)) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + _EPS)
        return (y * self.weight + self.bias).astype(x.dtype)


@final
class RMSNorm(Norm):
    """Root-mean-square normalisation ``x / rms(x) * g``, without re-centring (Zhang and
    Sennrich, 2019)."""

    weight: jax.Array

    def __init__(self, dim: int):
        self.weight = jnp.ones((dim,))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + _EPS)
        return (y * self.weight).astype(x.dtype)


@final
class ScaledL2Norm(Norm):
    """Scaled l2 normalisation ``g x / ||x||`` with one learned radius g (Nguyen and Salazar,
    2019, "Transformers without Tears"), initialised to ``sqrt(D)`` so outputs start with unit
    rms."""

    gain: jax.Array

    def __init__(self, dim: int):
        self.gain = jnp.asarray(dim ** 0.5, jnp.float32)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, -1, keepdims=True) + _EPS)
        return (self.gain * y).astype(x.dtype)


@final
class AdaNorm(Norm):
    """AdaNorm ``z = C (1 - k y) * y`` with ``y`` standardised and no learned parameters
    (Xu et al., 2019, "Understanding and Improving Layer Normalization"). As in the paper,
    ``C (1 - k y)`` is treated as a constant in the backward pass."""

    scale: float = eqx.field(static=True, default=1.0)
    k: float = eqx.field(static=True, default=0.1)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = (x32 - x32.mean(-1, keepdims=True)) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + _EPS)
        return (jax.lax.stop_gradient(self.scale * (1 - self.k * y)) * y).astype(x.dtype)


@final
class PowerNorm(StatefulNorm):
    """PowerNorm (Shen et al., 2020, "PowerNorm: Rethinking Batch Normalization in
    Transformers"): divide by a running quadratic mean ``psi`` over the batch (no re-centring),
    updated as ``psi_t^2 = alpha psi_{t-1}^2 + (1 - alpha) mean_batch(x^2)``. Training steps
    use the previous ``psi`` and update the state; inference uses it without updating.
    Padded tokens (``mask`` False) are left out of the batch statistic."""

    weight: jax.Array
    bias: jax.Array
    index: eqx.nn.StateIndex
    alpha: float = eqx.field(static=True)

    def __init__(self, dim: int, alpha: float = 0.9):
        self.weight, self.bias = jnp.ones((dim,)), jnp.zeros((dim,))
        self.index = eqx.nn.StateIndex(jnp.ones((dim,), jnp.float32))
        self.alpha = alpha

    def __call__(self, x, state, *, mask=None, inference=False):
        if state is None:
            raise ValueError("PowerNorm needs its eqx.nn.State (build the model with "
                             "eqx.nn.make_with_state)")
        psi2 = state.get(self.index)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(psi2 + _EPS)
        if not inference:
            w = jnp.ones(x.shape[:-1]) if mask is None else mask.astype(jnp.float32)
            batch_sq = jnp.einsum("bl,bld->d", w, x32 * x32) / jnp.maximum(w.sum(), 1.0)
            new = self.alpha * psi2 + (1 - self.alpha) * jax.lax.stop_gradient(batch_sq)
            state = state.set(self.index, new)
        return (y * self.weight + self.bias).astype(x.dtype), state


NORMS = {"layer": LayerNorm, "rms": RMSNorm, "scaled_l2": ScaledL2Norm, "power": PowerNorm,
         "ada": lambda dim: AdaNorm()}


def make_norm(kind: str, dim: int) -> Norm:
    """A norm by name: ``"layer"``, ``"rms"``, ``"scaled_l2"``, ``"ada"`` or ``"power"``."""
    if kind not in NORMS:
        raise ValueError(f"unknown norm {kind!r}; choose one of {sorted(NORMS)}")
    return NORMS[kind](dim)
