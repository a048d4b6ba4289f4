"""Dynamic loss scaling for float16 training (Micikevicius et al., 2018, "Mixed Precision
Training").

float16 has 5 exponent bits: small gradients underflow to 0. The loss is multiplied by a
scale ``S`` before differentiation and the gradients divided by ``S`` after, in float32. When a
step's gradients are not finite (the scale overflowed float16) the update is skipped and ``S``
is multiplied by ``backoff``; after ``growth_interval`` finite steps in a row ``S`` is
multiplied by ``growth_factor``. The state is a small pytree: a pure state machine, like an
optax transformation's state, that lives in the train state and is checkpointed with it.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp


class LossScaleState(eqx.Module):
    """``scale`` (float32 scalar) and ``good_steps`` (int32: finite steps since the last change)."""

    scale: jax.Array
    good_steps: jax.Array


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """The loss-scale state machine.

    Args:
      init_scale: the first scale (``2**15`` is the usual start: it backs off in a few steps
        when too large).
      growth_interval: finite steps in a row before the scale grows.
      growth_factor, backoff: multipliers on growth and on a non-finite step.
      min_scale: the scale never goes below this.
    """

    init_scale: float = 2.0 ** 15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff: float = 0.5
    min_scale: float = 1.0

    def __post_init__(self):
        if self.init_scale <= 0 or self.growth_interval < 1:
            raise ValueError(f"DynamicLossScale: need init_scale > 0 and growth_interval >= 1, "
                             f"got {self.init_scale}, {self.growth_interval}")
        if not (self.growth_factor >= 1 and 0 < self.backoff < 1):
            raise ValueError(f"DynamicLossScale: need growth_factor >= 1 and 0 < backoff < 1, "
                             f"got {self.growth_factor}, {self.backoff}")

    def init(self) -> LossScaleState:
        return LossScaleState(jnp.asarray(self.init_scale, jnp.float32),
                              jnp.zeros((), jnp.int32))

    @staticmethod
    def scale_loss(state: LossScaleState, loss):
        return loss * state.scale.astype(loss.dtype)

    @staticmethod
    def unscale(state: LossScaleState, grads):
        """Gradients of the scaled loss, in float32, divided by the scale."""
        return jax.tree.map(lambda g: g.astype(jnp.float32) / state.scale, grads)

    def update(self, state: LossScaleState, finite) -> LossScaleState:
        """The next state after a step whose gradients were ``finite`` (a bool scalar)."""
        grow = finite & (state.good_steps + 1 >= self.growth_interval)
        scale = jnp.where(finite, jnp.where(grow, state.scale * self.growth_factor, state.scale),
                          jnp.maximum(state.scale * self.backoff, self.min_scale))
        good = jnp.where(finite & ~grow, state.good_steps + 1, 0)
        return LossScaleState(scale.astype(jnp.float32), good.astype(jnp.int32))


def all_finite(tree) -> jax.Array:
    """True when every floating-point leaf of ``tree`` is finite."""
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)
