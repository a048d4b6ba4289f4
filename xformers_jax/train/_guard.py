"""The trainer's guards: settings checked before a run, steps checked as it goes.

A diverging run must not report success. ``check_config`` refuses learning rates, warm-ups
and other optimizer settings outside their ranges before any data is made. Inside the jitted
step (``make_train_step``) a step whose loss, gradients or updates are not finite, or whose
batch holds token ids or labels out of range, changes nothing (the model and optimizer state
keep their values, as a float16 step with overflowing gradients already did) and reports
what went wrong as a bit mask, the metric ``faults``. The host reads these masks only where the
loop waits for the device anyway (logging, evaluation, checkpoints, the end) with
:class:`Guard`, in step order, before anything is written or saved: so a state after a fault
is never checkpointed, and the run stops with an error naming the first faulty step and what
was wrong. ``config.on_nonfinite="skip"`` instead skips non-finite steps and counts them
(the ``skipped`` metric), as float16's dynamic loss scale always does; either way more than
``config.max_consecutive_skips`` skipped steps in a row stop the run (a run whose every step
is skipped has diverged: it must not "finish").

Why a mask returned as a metric rather than ``checkify`` or ``eqx.error_if``: both would make
the host wait for every step to learn whether it failed (``checkify``'s error value must be
read; ``error_if`` raises through a host callback, not supported on every backend and not
inside every sharded program), while the mask costs a few reductions and is read at the
points where the loop synchronises already. The exact position of a bad value is found by the
numpy checks of the loaders and of ``make_task`` (``xformers_jax.data.check_range``); the
in-step count catches batches that bypass them (a user's own source).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

ON_NONFINITE = ("stop", "skip")

# The bits of the ``faults`` metric.
LOSS, GRADIENT, UPDATE, DATA = 1, 2, 4, 8
_NAMES = {LOSS: "non-finite loss", GRADIENT: "non-finite gradient",
          UPDATE: "non-finite parameter update", DATA: "token ids or labels out of range"}
# The loss function's count of out-of-range token ids and labels in its batch (the step
# folds it into ``faults``).
INVALID_DATA = "invalid_data"


class NonFiniteError(FloatingPointError):
    """A training step's loss, gradients or update were not finite (the run stopped; nothing
    after the last good step was saved)."""


class InvalidDataError(ValueError):
    """A batch held token ids or labels outside the task's vocabulary or classes."""


def describe(faults: int) -> str:
    """``"non-finite loss, non-finite gradient"`` for the bits of a ``faults`` value."""
    return ", ".join(name for bit, name in _NAMES.items() if faults & bit) or "none"


def count_invalid(batch, *, vocab_size: int, num_classes: int | None):
    """The number of token ids (integer ``inputs*`` arrays) outside ``[0, vocab_size)`` and
    labels (``targets``) outside ``[0, num_classes)`` in ``batch``: an int32 scalar, inside
    jit (``num_classes=None``: no labels to check)."""
    total = jnp.zeros((), jnp.int32)
    for key, x in batch.items():
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
            continue
        high = num_classes if key == "targets" else vocab_size if key.startswith(
            "inputs") else None
        if high is not None:
            total += jnp.sum((x < 0) | (x >= high), dtype=jnp.int32)
    return total


def step_faults(loss, grads_finite, updates_finite, invalid):
    """The ``faults`` mask of one step (float32 scalar: 0 when the step is sound)."""
    mask = jnp.where(jnp.isfinite(loss), 0, LOSS) + jnp.where(grads_finite, 0, GRADIENT)
    mask = mask + jnp.where(updates_finite, 0, UPDATE)
    if invalid is not None:
        mask = mask + jnp.where(invalid > 0, DATA, 0)
    return mask.astype(jnp.float32)


def _check_number(name, value, *, low=None, high=None, low_open=False, high_open=False,
                  allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    ok = math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}, "
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        span = f"{lo or '(-inf, '}{hi or 'inf)'}"
        raise ValueError(f"{name}={value!r} is outside its range {span}")


def check_config(config) -> None:
    """ValueError naming the first optimizer, loss-scale or guard setting outside its range.

    AdamW moves every parameter by about ``learning_rate`` per step whatever the gradient's
    size, so a rate above 1 destroys weights initialised at ~0.1 in a step; a negative
    warm-up, NaN or infinite values are never meant.
    """
    o = config.optim
    _check_number("optim.learning_rate", o.learning_rate, low=0, high=1, low_open=True)
    _check_number("optim.ssm_learning_rate", o.ssm_learning_rate, low=0, high=1,
                  low_open=True, allow_none=True)
    _check_number("optim.warmup_steps", o.warmup_steps, low=0)
    if int(o.warmup_steps) != o.warmup_steps:
        raise ValueError(f"optim.warmup_steps must be a whole number, got {o.warmup_steps!r}")
    _check_number("optim.weight_decay", o.weight_decay, low=0)
    _check_number("optim.grad_clip_norm", o.grad_clip_norm)  # <= 0 turns clipping off
    _check_number("optim.b1", o.b1, low=0, high=1, high_open=True)
    _check_number("optim.b2", o.b2, low=0, high=1, high_open=True)
    _check_number("loss_scale.init_scale", config.loss_scale.init_scale, low=0, low_open=True)
    _check_number("loss_scale.growth_interval", config.loss_scale.growth_interval, low=1)
    if config.on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got "
                         f"{config.on_nonfinite!r}")
    _check_number("max_consecutive_skips", config.max_consecutive_skips, low=1)


class Guard:
    """Reads the steps' ``faults`` on the host, in step order, where the loop synchronises.

    Args:
      on_nonfinite: "stop" (a non-finite step stops the run) or "skip" (it is skipped and
        counted). Steps with data out of range always stop the run.
      max_consecutive_skips: more skipped steps in a row than this stop the run.
      loss_scaled: float16 training: a non-finite loss or gradient is the dynamic loss
        scale's overflow, always skipped (and bounded), whatever ``on_nonfinite`` says.
    """

    def __init__(self, on_nonfinite: str = "stop", max_consecutive_skips: int = 25, *,
                 loss_scaled: bool = False):
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got "
                             f"{on_nonfinite!r}")
        self.skip = on_nonfinite == "skip"
        self.loss_scaled = loss_scaled
        self.max_consecutive_skips = int(max_consecutive_skips)
        self.consecutive = 0
        self._pending: list = []

    def add(self, step: int, faults, metrics) -> None:
        """Keeps step ``step``'s ``faults`` (a device scalar: no wait) with its loss and
        gradient norm for the message."""
        self._pending.append((step, faults, metrics.get("loss"), metrics.get("grad_norm")))

    def check(self) -> None:
        """Raises for the first faulty step not yet checked (see the class docstring)."""
        pending, self._pending = jax.device_get(self._pending), []
        for step, faults, loss, grad_norm in pending:
            faults = int(faults)
            if not faults:
                self.consecutive = 0
                continue
            values = f"loss {float(loss)!r}, gradient norm {float(grad_norm)!r}"
            if faults & DATA:
                raise InvalidDataError(
                    f"step {step}: the batch holds token ids or labels outside the task's "
                    "vocabulary or classes (the loaders and make_task check their arrays; a "
                    "source of your own bypasses them: see xformers_jax.data.check_arrays)")
            skippable = self.skip or (self.loss_scaled and not faults & UPDATE)
            if not skippable:
                raise NonFiniteError(
                    f"step {step}: {describe(faults)} ({values}); the run stopped and the "
                    "update was not applied: checkpoints hold only steps before it. Lower "
                    "optim.learning_rate, raise optim.warmup_steps or check the data; "
                    "on_nonfinite='skip' skips such steps instead")
            self.consecutive += 1
            if self.consecutive > self.max_consecutive_skips:
                raise NonFiniteError(
                    f"step {step}: {self.consecutive} steps in a row skipped ({describe(faults)};"
                    f" {values}): the run has diverged (max_consecutive_skips="
                    f"{self.max_consecutive_skips}); skipped steps changed nothing, so no "
                    "checkpoint holds a non-finite state")
