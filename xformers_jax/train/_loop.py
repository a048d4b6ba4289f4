"""``train_and_evaluate``: the one training loop behind ``experiments/train.py``."""

from __future__ import annotations

import signal
import time

import jax
import numpy as np
from absl import logging

from ..data import DataIterator
from ._checkpoint import Checkpointer
from ._config import validate_config
from ._metrics import MetricWriter
from ._optim import make_optimizer, make_schedule
from ._state import create_train_state
from ._step import make_eval_step, make_train_step
from ._tasks import build_model, make_loss_fn, make_metrics_fn, make_task


def evaluate(eval_step, model, source, batch_size: int) -> dict[str, float]:
    """Mean loss and accuracy over a whole split, in order (the last batch may be short)."""
    it = DataIterator(source, batch_size=min(batch_size, len(source)), shuffle=False,
                      num_epochs=1, drop_remainder=False)
    totals = {}
    for batch in it:
        for k, v in eval_step(model, batch).items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return {"loss": totals["loss_sum"] / totals["count"],
            "accuracy": totals["correct"] / totals["count"]}


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


class _Preemption:
    """Turns SIGTERM into a flag the loop checks after each step (then it saves and exits)."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self):
        signal.signal(signal.SIGTERM, self._previous)


def train_and_evaluate(config, workdir: str, *, on_step=None) -> dict:
    """Trains per ``config`` in ``workdir``, resuming from its latest checkpoint.

    Periodically logs train metrics (with steps/s and ETA), evaluates on the validation split
    (offering the state to the best checkpoint), checkpoints the train state with the data
    iterator's position; at the end evaluates the best checkpoint on the test split.
    SIGTERM saves a checkpoint at the current step and returns ``{"preempted": True, "step"}``.
    ``on_step(step)`` is called after every step (tests use it to interrupt a run).

    Returns the final metrics: ``{"step", "validation_accuracy", "test_accuracy", ...}``.
    """
    validate_config(config)
    task = make_task(config.data, config.seed)
    init_key, state_key = jax.random.split(jax.random.PRNGKey(config.seed))
    model = build_model(config.model, task, init_key)
    o = config.optim
    schedule = make_schedule(o.schedule, learning_rate=o.learning_rate,
                             warmup_steps=o.warmup_steps, total_steps=config.num_train_steps)
    optimizer = make_optimizer(schedule, weight_decay=o.weight_decay,
                               grad_clip_norm=o.grad_clip_norm, b1=o.b1, b2=o.b2)
    state = create_train_state(model, optimizer, state_key)
    train_iter = DataIterator(task.train, batch_size=config.batch_size, seed=config.seed,
                              process_index=jax.process_index(),
                              process_count=jax.process_count())
    checkpointer = Checkpointer(workdir, keep=config.keep_checkpoints)
    restored = checkpointer.restore_latest(state)
    if restored is not None:
        state, data_state = restored
        train_iter.set_state(data_state)
        logging.info("resumed from step %d", int(state.step))
    train_step = make_train_step(make_loss_fn(task), optimizer,
                                 num_microbatches=config.num_microbatches)
    eval_step = make_eval_step(make_metrics_fn(task))
    writer = MetricWriter(workdir, tensorboard=config.tensorboard)
    preemption = _Preemption()
    step, total = int(state.step), config.num_train_steps
    start_step, start_time = step, time.perf_counter()
    validation = {}
    try:
        while step < total:
            state, metrics = train_step(state, next(train_iter))
            step += 1
            if step % config.log_every == 0 or step == total:
                rate = (step - start_step) / (time.perf_counter() - start_time)
                row = {k: float(v) for k, v in metrics.items()}
                row["learning_rate"] = float(schedule(step - 1))
                writer.write(step, {f"train_{k}": v for k, v in row.items()}
                             | {"steps_per_second": rate})
                logging.info("step %d/%d (%.0f%%) %.2f steps/s ETA %s loss %.4f acc %.3f",
                             step, total, 100 * step / total, rate,
                             _duration((total - step) / max(rate, 1e-9)), row["loss"],
                             row.get("accuracy", np.nan))
            if step % config.eval_every == 0 or step == total:
                validation = evaluate(eval_step, state.model, task.validation, config.batch_size)
                writer.write(step, {f"validation_{k}": v for k, v in validation.items()})
                checkpointer.save_best(step, state, train_iter.get_state(), validation)
            if step % config.checkpoint_every == 0 or step == total:
                checkpointer.save(step, state, train_iter.get_state(), force=True)
            if on_step is not None:
                on_step(step)
            if preemption.requested and step < total:
                logging.warning("SIGTERM at step %d: saving and exiting", step)
                checkpointer.save(step, state, train_iter.get_state(), force=True)
                return {"preempted": True, "step": step}
        checkpointer.wait()
        best = checkpointer.restore_best(state)
        best_state = state if best is None else best[0]
        test = evaluate(eval_step, best_state.model, task.test, config.batch_size)
        writer.write(step, {f"test_{k}": v for k, v in test.items()})
        result = {"step": step, "best_step": int(best_state.step)}
        result |= {f"validation_{k}": v for k, v in validation.items()}
        result |= {f"test_{k}": v for k, v in test.items()}
        logging.info("finished: %s", result)
        return result
    finally:
        preemption.restore()
        checkpointer.wait()
        checkpointer.close()
        writer.close()
