"""The jitted train step (gradient accumulation over micro-batches) and the eval step."""

from __future__ import annotations

import contextlib
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ._guard import INVALID_DATA, step_faults
from ._loss_scale import DynamicLossScale, all_finite
from ._optim import trainable_mask
from ._state import TrainState

# loss_fn(model, batch, key) -> (scalar loss, {metric name: scalar}).
LossFn = Callable


def _split_microbatches(batch, num_microbatches: int):
    def split(x):
        if x.shape[0] % num_microbatches:
            raise ValueError(f"batch size {x.shape[0]} is not divisible by "
                             f"num_microbatches={num_microbatches}")
        return x.reshape(num_microbatches, x.shape[0] // num_microbatches, *x.shape[1:])
    return jax.tree.map(split, batch)


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                    num_microbatches: int = 1, loss_scale: DynamicLossScale | None = None,
                    sharding=None, count_skipped: bool = False):
    """``step(state, batch) -> (state, metrics)``, jitted, donating the old state's buffers.

    With ``num_microbatches > 1`` the batch is cut into equal micro-batches whose gradients and
    metrics are averaged in a ``lax.scan`` (one micro-batch's activations live at a time); the
    update equals one step on the whole batch when the loss is a mean over examples.
    With ``loss_scale`` (float16 training; the state needs ``create_train_state(...,
    loss_scale=)``) the loss is scaled before differentiation and the gradients unscaled in
    float32; a step with non-finite gradients changes neither the model nor the optimizer
    state (only the scale and the key). Metrics are the loss function's plus ``loss`` and
    ``grad_norm`` (and ``loss_scale``, ``skipped`` with loss scaling or ``count_skipped``).
    Only the trainable arrays (``trainable``: not fixed buffers) are differentiated and
    updated. Any step whose loss, gradients or updates are not finite, or whose loss function
    counts out-of-range data (its ``invalid_data`` metric), keeps the model and optimizer
    state unchanged and says why in the metric ``faults`` (a bit mask, ``_guard``; 0 when the
    step is sound), which the trainer's ``Guard`` reads.
    With ``sharding`` (a ``ShardingPlan``, as the trainer always gives) the jit has the plan's
    state and batch shardings in and out (metrics replicated) and is traced inside the plan's
    mesh context.
    """
    def scaled_loss(params, rest, batch, key, scale):
        loss, metrics = loss_fn(eqx.combine(params, rest), batch, key)
        return loss * scale, (loss, metrics)

    grad_fn = eqx.filter_value_and_grad(scaled_loss, has_aux=True)

    def step(state: TrainState, batch):
        key, step_key = jax.random.split(state.key)
        scale = 1.0 if loss_scale is None else state.loss_scale.scale
        # A carried state (memories of segment-level recurrence) enters the loss with the batch
        # and comes back among its metrics; it is not differentiated.
        carried = state.carry is not None
        if carried:
            if num_microbatches != 1:
                raise ValueError("a carried state (model memory) needs num_microbatches=1: "
                                 "micro-batches would cut the streams the memory follows")
            batch = dict(batch, carry=state.carry)
        # Fixed buffers (random features, ...) are neither differentiated nor updated.
        params, rest = eqx.partition(state.model, trainable_mask(state.model))
        if num_microbatches == 1:
            (_, (loss, metrics)), grads = grad_fn(params, rest, batch, step_key, scale)
        else:
            micro = _split_microbatches(batch, num_microbatches)
            keys = jax.random.split(step_key, num_microbatches)

            def accumulate(carry, xs):
                mb, k = xs
                (_, (loss, metrics)), grads = grad_fn(params, rest, mb, k, scale)
                grads = eqx.filter(grads, eqx.is_inexact_array)
                return jax.tree.map(jnp.add, carry, (loss, metrics, grads)), None

            first = jax.tree.map(lambda x: x[0], micro)
            (_, aux), _ = eqx.filter_eval_shape(grad_fn, params, rest, first, keys[0], scale)
            zeros = (*jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux),
                     jax.tree.map(jnp.zeros_like, params))
            (loss, metrics, grads), _ = jax.lax.scan(
                accumulate, zeros, (micro, keys))
            loss, metrics, grads = jax.tree.map(lambda x: x / num_microbatches,
                                                (loss, metrics, grads))
        metrics = dict(metrics)
        new_carry = metrics.pop("carry") if carried else None
        invalid = metrics.pop(INVALID_DATA, None)
        new_scale = None
        if loss_scale is not None:
            grads = loss_scale.unscale(state.loss_scale, grads)
        grads_finite = all_finite(grads)
        if loss_scale is not None:
            new_scale = loss_scale.update(state.loss_scale, grads_finite)
            # Zero non-finite gradients so that the skipped branch computes nothing NaN.
            grads = jax.tree.map(lambda g: jnp.where(grads_finite, g, 0), grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        faults = step_faults(loss, grads_finite, all_finite(updates), invalid)
        model = eqx.apply_updates(state.model, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        # A faulty step changes neither the model nor the optimizer state (only the key, the
        # step count and the loss scale move on). A cond, not an elementwise select: the new
        # values are computed outside it exactly as without the guard (a select fused into
        # `params + updates` may round differently by an ulp).
        sound = faults == 0
        new, static = eqx.partition((model, opt_state), eqx.is_array)
        old = eqx.filter((state.model, state.opt_state), eqx.is_array)
        model, opt_state = eqx.combine(jax.lax.cond(sound, lambda: new, lambda: old), static)
        if loss_scale is not None:
            metrics.update(loss_scale=state.loss_scale.scale,
                           skipped=(~sound).astype(jnp.float32))
        elif count_skipped:
            metrics.update(skipped=(~sound).astype(jnp.float32))
        metrics["faults"] = faults
        return TrainState(step=state.step + 1, model=model, opt_state=opt_state,
                          key=key, loss_scale=new_scale, carry=new_carry), metrics

    def on_arrays(arrays, static, batch):
        new, metrics = step(eqx.combine(arrays, static), batch)
        return eqx.filter(new, eqx.is_array), metrics

    # One path: a plan adds its shardings and mesh context; without one (a caller's own loop)
    # the same jit runs where the arrays are. The old state's buffers are donated.
    shardings = {} if sharding is None else dict(
        in_shardings=(sharding.state, sharding.batch),
        out_shardings=(sharding.state, NamedSharding(sharding.mesh, PartitionSpec())))
    jitted = jax.jit(on_arrays, static_argnums=1, donate_argnums=0, **shardings)

    def run(state, batch):
        arrays, static = eqx.partition(state, eqx.is_array)
        with _context(sharding):
            new, metrics = jitted(arrays, static, batch)
        return eqx.combine(new, static), metrics

    return run


def _context(sharding):
    return contextlib.nullcontext() if sharding is None else sharding.context()


def make_eval_step(metrics_fn: Callable, sharding=None):
    """``eval_step(model, batch) -> {name: sum over the batch}`` (jitted, no randomness),
    traced inside ``sharding.context()`` when a ``ShardingPlan`` is given."""
    jitted = eqx.filter_jit(metrics_fn)

    def run(model, batch):
        with _context(sharding):
            return jitted(model, batch)

    return run
