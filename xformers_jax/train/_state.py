"""The train state: one pytree holding everything a step changes."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ._loss_scale import DynamicLossScale, LossScaleState
from ._optim import trainable


class TrainState(eqx.Module):
    """``step`` (int32 scalar), ``model`` (an Equinox module), ``opt_state``, ``key``.

    ``key`` is a raw ``uint32[2]`` PRNG key, split once per step for dropout and other
    randomness, so a restored state draws the same randomness as one that never stopped.
    ``loss_scale`` is the dynamic loss scale's state (float16 training) or None.
    ``carry`` is what the model carries from one step to the next (the memories of a model
    with segment-level recurrence, fed by contiguous streams) or None; it is checkpointed with
    the rest, so a resumed run continues with the same memories.
    """

    step: jax.Array
    model: eqx.Module
    opt_state: optax.OptState
    key: jax.Array
    loss_scale: LossScaleState | None = None
    carry: object = None


def create_train_state(model: eqx.Module, optimizer: optax.GradientTransformation,
                       key: jax.Array, *, loss_scale: DynamicLossScale | None = None,
                       carry=None) -> TrainState:
    """A step-0 state: the optimizer initialised on the model's trainable arrays (its
    floating-point arrays but the fixed buffers, ``_optim.trainable``) and the loss-scale
    state machine's first state for float16 training."""
    params = trainable(model)
    return TrainState(step=jnp.zeros((), jnp.int32), model=model,
                      opt_state=optimizer.init(params), key=key,
                      loss_scale=None if loss_scale is None else loss_scale.init(),
                      carry=carry)
