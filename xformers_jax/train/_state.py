"""The train state: one pytree holding everything a step changes."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax


class TrainState(eqx.Module):
    """``step`` (int32 scalar), ``model`` (an Equinox module), ``opt_state``, ``key``.

    ``key`` is a raw ``uint32[2]`` PRNG key, split once per step for dropout and other
    randomness, so a restored state draws the same randomness as one that never stopped.
    """

    step: jax.Array
    model: eqx.Module
    opt_state: optax.OptState
    key: jax.Array


def create_train_state(model: eqx.Module, optimizer: optax.GradientTransformation,
                       key: jax.Array) -> TrainState:
    """A step-0 state: the optimizer initialised on the model's floating-point arrays."""
    params = eqx.filter(model, eqx.is_inexact_array)
    return TrainState(step=jnp.zeros((), jnp.int32), model=model,
                      opt_state=optimizer.init(params), key=key)
