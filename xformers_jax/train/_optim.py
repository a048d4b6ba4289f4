"""Learning-rate schedules and the optimizer (optax AdamW with clipping).

Weight decay applies by what a parameter is (``axes.decayed``): weight matrices (declared with
two or more logical axes, or undeclared arrays with two or more dimensions besides a layer
stack's ``layers`` axis) decay; biases, gains, norm scales and position tables (declared
``decay=False``) do not. Fixed buffers (``axes.Buffer``: random features, LSH rotations,
ALiBi's slopes) are not optimizer parameters at all (:func:`trainable`): no optimizer state,
no update, not in the gradient norm; checkpoints keep them with the model.

State space parameters (``nn.SSM_PARAMETERS``: S4D/S5's ``log_dt``, ``A`` and ``B``, Mamba's
``a_log`` and ``dt_bias``) are never weight-decayed and may have their own learning rate
(``ssm_schedule``): the S4 line of work trains them with a smaller rate and no decay (Gu et al.
2022, "Efficiently Modeling Long Sequences with Structured State Spaces"; Gu et al. 2022, S4D),
and its LRA results depend on it.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .. import axes, nn

SCHEDULES = ("constant", "rsqrt", "cosine")


def make_schedule(name: str, *, learning_rate: float, warmup_steps: int,
                  total_steps: int) -> optax.Schedule:
    """Linear warmup to ``learning_rate``, then constant, rsqrt or cosine decay.

    rsqrt (Vaswani et al. 2017, as in LRA): ``lr * sqrt(warmup / max(step, warmup))``;
    cosine: to 0 at ``total_steps``.
    """
    warmup = max(int(warmup_steps), 1)
    if name == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps,
                                                  max(total_steps, warmup_steps + 1))

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        ramp = jnp.minimum(1.0, (step + 1) / warmup)
        if name == "rsqrt":
            return learning_rate * ramp * jnp.sqrt(warmup / jnp.maximum(step + 1, warmup))
        return learning_rate * ramp

    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    return schedule


def trainable_mask(model):
    """True for each floating-point array of ``model`` the optimizer trains (every one but
    the fixed buffers, ``axes.Buffer``); False elsewhere (a filter spec for
    ``eqx.partition``)."""
    buffers = axes.fixed_buffers(model)
    return jax.tree.map(lambda leaf, b: eqx.is_inexact_array(leaf) and not b, model, buffers,
                        is_leaf=lambda x: x is None)


def trainable(model):
    """``model``'s trainable arrays (``eqx.filter`` by :func:`trainable_mask`): what the
    optimizer is initialised on and updates."""
    return eqx.filter(model, trainable_mask(model))


def _decay_mask(params):
    # Weights decay by their declared role (axes.decayed); state space parameters never do.
    ssm = nn.ssm_parameters(params)
    return jax.tree.map(lambda d, s: bool(d) and not s, axes.decayed(params), ssm)


def _ssm_rate(schedule, ssm_schedule) -> optax.GradientTransformation:
    """Rescales the state space parameters' AdamW updates from ``schedule`` to
    ``ssm_schedule``. Adam's direction is per parameter and the learning rate its last factor
    (and these parameters are not decayed), so this is exactly a second parameter group with
    its own rate, while the optimizer state keeps the parameters' tree structure (the
    trainer shards it like the parameters)."""

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        del params
        main = schedule(state.count)
        ratio = jnp.where(main > 0, ssm_schedule(state.count) / jnp.where(main > 0, main, 1), 0)
        ssm = nn.ssm_parameters(updates)
        updates = jax.tree.map(lambda u, s: u * ratio.astype(u.dtype) if s else u, updates, ssm)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def make_optimizer(schedule: optax.Schedule, *, weight_decay: float, grad_clip_norm: float,
                   b1: float = 0.9, b2: float = 0.98, eps: float = 1e-9,
                   ssm_schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
    """Global-norm clipping (skipped when ``grad_clip_norm <= 0``) then AdamW.

    ``ssm_schedule``: the learning rate of the state space parameters (their own parameter
    group: their AdamW updates, without weight decay, rescaled to this schedule); None: one
    schedule for all (they are still not decayed).
    """
    adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                        mask=_decay_mask)
    if ssm_schedule is not None:
        adamw = optax.chain(adamw, _ssm_rate(schedule, ssm_schedule))
    if grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(grad_clip_norm), adamw)
    return adamw
