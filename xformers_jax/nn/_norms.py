"""Normalisation layers (practical survey P 3; Lin et al. survey L 5.2).

Every norm takes ``x: [B, L, D]`` and computes its statistics in float32, returning x's dtype.
:class:`PowerNorm` has running statistics in ``eqx.nn.State`` and is called as
``norm(x, state, mask=...) -> (y, state)``; the others ignore ``state``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

_EPS = 1e-6


class Norm(eqx.Module):
    """Base class: ``__call__(x, state=None, *, mask=None, inference=False) -> (y, state)``."""

    stateful = False


class LayerNorm(Norm):
    """Layer normalisation with a learned gain and bias (survey L 2.1.3)."""

    weight: jax.Array
    bias: jax.Array

    def __init__(self, dim: int):
        self.weight, self.bias = jnp.ones((dim,)), jnp.zeros((dim,))

    def __call__(self, x, state=None, *, mask=None, inference=False):
        x32 = x.astype(jnp.float32)
        y = (x32 - x32.mean(-1, keepdims=True)) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + _EPS)
        return (y * self.weight + self.bias).astype(x.dtype), state


class RMSNorm(Norm):
    """Root-mean-square normalisation: ``x / rms(x) * g`` (no re-centring)."""

    weight: jax.Array

    def __init__(self, dim: int):
        self.weight = jnp.ones((dim,))

    def __call__(self, x, state=None, *, mask=None, inference=False):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + _EPS)
        return (y * self.weight).astype(x.dtype), state


class ScaledL2Norm(Norm):
    """Scaled l2 normalisation ``g x / ||x||`` with one learned radius g (survey L eq. 41),
    initialised to ``sqrt(D)`` so outputs start with unit rms."""

    gain: jax.Array

    def __init__(self, dim: int):
        self.gain = jnp.asarray(dim ** 0.5, jnp.float32)

    def __call__(self, x, state=None, *, mask=None, inference=False):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, -1, keepdims=True) + _EPS)
        return (self.gain * y).astype(x.dtype), state


class AdaNorm(Norm):
    """AdaNorm ``z = C (1 - k y) * y`` with ``y`` standardised and no learned parameters
    (survey L eqs. 39-40). As in Xu et al., ``C (1 - k y)`` is treated as a constant in the
    backward pass."""

    scale: float = eqx.field(static=True, default=1.0)
    k: float = eqx.field(static=True, default=0.1)

    def __call__(self, x, state=None, *, mask=None, inference=False):
        x32 = x.astype(jnp.float32)
        y = (x32 - x32.mean(-1, keepdims=True)) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + _EPS)
        return (jax.lax.stop_gradient(self.scale * (1 - self.k * y)) * y).astype(x.dtype), state


class PowerNorm(Norm):
    """PowerNorm (Shen et al.; survey L eqs. 42-44): divide by a running quadratic mean
    ``psi`` over the batch (no re-centring), updated as
    ``psi_t^2 = alpha psi_{t-1}^2 + (1 - alpha) mean_batch(x^2)``. Training steps use the
    previous ``psi`` (eq. 43) and update the state; inference uses it without updating.
    Padded tokens (``mask`` False) are left out of the batch statistic."""

    weight: jax.Array
    bias: jax.Array
    index: eqx.nn.StateIndex
    alpha: float = eqx.field(static=True)
    stateful = True

    def __init__(self, dim: int, alpha: float = 0.9):
        self.weight, self.bias = jnp.ones((dim,)), jnp.zeros((dim,))
        self.index = eqx.nn.StateIndex(jnp.ones((dim,), jnp.float32))
        self.alpha = alpha

    def __call__(self, x, state=None, *, mask=None, inference=False):
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
