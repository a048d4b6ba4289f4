"""Learning-rate schedules and the optimizer (optax AdamW with clipping)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

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


def _decay_mask(params):
    # Weight decay on matrices only: biases, norm scales and other vectors are not decayed.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(schedule: optax.Schedule, *, weight_decay: float, grad_clip_norm: float,
                   b1: float = 0.9, b2: float = 0.98, eps: float = 1e-9
                   ) -> optax.GradientTransformation:
    """Global-norm clipping (skipped when ``grad_clip_norm <= 0``) then AdamW."""
    adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                        mask=_decay_mask)
    if grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(grad_clip_norm), adamw)
    return adamw
