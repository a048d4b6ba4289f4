"""``train_and_evaluate``: the one training loop behind ``xformers_jax_experiments/train.py``."""

from __future__ import annotations

import signal

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from .. import axes as X
from .. import nn, parallel
from ..data import DataIterator
from ._checkpoint import Checkpointer
from ._compress import Compression
from ._config import base_config, validate_config
from ._lock import acquire_for_job
from ._guard import INVALID_DATA, Guard, InvalidDataError
from ._loss_scale import DynamicLossScale
from ._metrics import IntervalMean, MetricWriter
from ._optim import make_optimizer, make_schedule
from ._progress import ProgressBar, format_duration
from ._record import RunRecord
from ._sharding import make_sharding_plan, resolve_mesh
from ._state import create_train_state
from ._step import make_eval_step, make_train_step
from ._objective import make_loss_fn, make_metrics_fn
from ._tasks import build_model, make_task, spec_of


def evaluate(eval_step, model, source, batch_size: int) -> dict[str, float]:
    """Mean loss and accuracy over a whole split, in order (the last batch may be short)."""
    size = min(batch_size, len(source))
    it = DataIterator(source, batch_size=size, shuffle=False, num_epochs=1, drop_remainder=False)
    totals = {}
    for i, batch in enumerate(it):
        for k, v in eval_step(model, batch).items():
            totals[k] = totals.get(k, 0.0) + float(v)
        if totals.get(INVALID_DATA):
            raise InvalidDataError(
                f"evaluation batch {i} (examples {i * size}..) holds "
                f"{int(totals[INVALID_DATA])} token ids or labels outside the task's vocabulary "
                "or classes (xformers_jax.data.check_arrays finds them)")
    return {"loss": totals["loss_sum"] / totals["count"],
            "accuracy": totals["correct"] / totals["count"]}


def _precision(config):
    """``(nn.Policy | None, DynamicLossScale | None)`` for ``config.precision``."""
    if config.precision == "float32":
        return None, None
    policy = nn.Policy(compute=jnp.dtype(config.precision))
    if config.precision != "float16":
        return policy, None
    return policy, DynamicLossScale(init_scale=config.loss_scale.init_scale,
                                    growth_interval=config.loss_scale.growth_interval)


def _majority_accuracy(task) -> float | None:
    """Test accuracy of always answering the most common training label (the baseline a
    classifier must beat); None for language models and lazily read splits."""
    if not spec_of(task).classification or not all(
            hasattr(s, "arrays") for s in (task.train, task.test)):
        return None
    majority = np.bincount(task.train.arrays["targets"]).argmax()
    return float(np.mean(task.test.arrays["targets"] == majority))


class _Preemption:
    """Whether to stop after a step because of SIGTERM: the same step on every process.

    One process: a SIGTERM handler sets a flag that the loop reads after each step. Several
    processes: JAX's preemption sync point (``multihost_utils.reached_preemption_sync_point``,
    asked after every step). The coordination service's notifier, installed by
    ``jax.distributed.initialize``, catches SIGTERM on any process (within about a second);
    the processes then agree on one step past the largest any of them has reached, and all of
    them are told to stop at it. (Processes stopping on their own SIGTERM stopped at different
    steps, each waiting for the others in its checkpoint's barrier.) No Python handler then:
    it would replace the notifier's.
    """

    def __init__(self):
        self.requested = False
        self.several = jax.process_count() > 1
        if not self.several:
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def stop(self, step: int) -> bool:
        """Called after every step by every process; True: save ``step`` and stop."""
        if self.several:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def restore(self):
        if not self.several:
            signal.signal(signal.SIGTERM, self._previous)


def train_and_evaluate(config, workdir: str, *, on_step=None,
                       allow_config_change: bool = False) -> dict:
    """Trains per ``config`` in ``workdir`` (see ``_train_and_evaluate``), owning it.

    Takes the workdir's lock (``_lock.py``: a second trainer raises ``WorkdirLocked`` naming
    the first) and checks and extends its run record (``_record.py``): a config other than
    the recorded one raises ``ConfigChanged`` unless ``allow_config_change``; a finished run
    returns its recorded result with ``already_finished=True`` and writes nothing. How each
    start ends (finished, preempted, or failed and why) is recorded in its session with its
    wall and CPU seconds.
    """
    validate_config(config)
    lock = acquire_for_job(workdir)
    try:
        record = RunRecord(workdir, writer=jax.process_index() == 0)
        finished = record.begin(config, allow_config_change=allow_config_change,
                                defaults=base_config(config.data.task, config.model.kind))
        if finished is not None:
            logging.warning("run already finished at step %d; nothing to do", finished["step"])
            return {**finished, "already_finished": True}
        try:
            result = _train_and_evaluate(config, workdir, on_step=on_step)
        except BaseException as e:
            try:  # the record says how the start ended; the error itself propagates
                record.end(f"failed: {type(e).__name__}: {e}")
            except Exception as record_error:  # noqa: BLE001
                logging.error("could not record the failure in run.json: %s", record_error)
            raise
        record.end("preempted" if result.get("preempted") else "finished", result.get("step"))
        if not result.get("preempted"):
            record.finish(result)
        return result
    finally:
        lock.release()


def _train_and_evaluate(config, workdir: str, *, on_step=None) -> dict:
    """Trains per ``config`` in ``workdir``, resuming from its latest checkpoint.

    Sharded per ``config.mesh`` and ``config.sharding`` (``make_sharding_plan``; by default
    data parallel over every device of every process): ``batch_size`` is the global batch.
    Shows a progress bar (steps/s, ETA) on stderr, logs the train metrics' means over each
    interval of ``log_every`` steps, evaluates on the validation split (offering the state to
    the best checkpoint),
    checkpoints the train state with the data iterator's position; at the end evaluates the
    best checkpoint on the test split.
    SIGTERM saves a checkpoint at the current step and returns ``{"preempted": True, "step"}``;
    on several processes all of them stop after the same step (JAX's preemption sync point),
    whichever of them received it.
    ``on_step(step)`` is called after every step (tests use it to interrupt a run).
    ``config.precision`` runs the model in bfloat16 or float16 (with dynamic loss scaling).

    Returns the final metrics: ``{"step", "validation_accuracy", "test_accuracy", ...}``.
    """
    validate_config(config)
    task = make_task(config.data, config.seed)
    init_key, state_key = jax.random.split(jax.random.PRNGKey(config.seed))
    shards = resolve_mesh(config.mesh).get(X.SEQUENCE, 1)
    model = build_model(config.model, task, init_key, sequence_shards=shards)
    o = config.optim
    schedule = make_schedule(o.schedule, learning_rate=o.learning_rate,
                             warmup_steps=o.warmup_steps, total_steps=config.num_train_steps)
    ssm_schedule = None if o.ssm_learning_rate is None else make_schedule(
        o.schedule, learning_rate=o.ssm_learning_rate, warmup_steps=o.warmup_steps,
        total_steps=config.num_train_steps)
    optimizer = make_optimizer(schedule, weight_decay=o.weight_decay,
                               grad_clip_norm=o.grad_clip_norm, b1=o.b1, b2=o.b2,
                               ssm_schedule=ssm_schedule)
    policy, loss_scale = _precision(config)
    # Quantization, pruning and distillation change the model, optimizer and loss to train.
    compression = Compression(config, task, init_key)
    model, optimizer, loss_fn = compression.wrap(
        model, optimizer, make_loss_fn(task, policy, config.loss, kind=config.model.kind))
    spec = spec_of(task)
    # A model that carries state across batches (memories over contiguous streams) keeps it
    # in the train state, so it is checkpointed and restored with the rest.
    carry = None if spec.carry is None else spec.carry(model, config.batch_size, False)
    state = create_train_state(model, optimizer, state_key, loss_scale=loss_scale, carry=carry)
    run_eval = spec.evaluate or evaluate
    plan = make_sharding_plan(config, state, optimizer)
    if config.batch_size % plan.batch_shards:
        raise ValueError(f"batch_size={config.batch_size} is not divisible by the "
                         f"{plan.batch_shards} batch shards of the mesh")
    pipeline = plan.pipeline_report(config.batch_size // config.num_microbatches)
    if pipeline:
        logging.info("GPipe over %d stages, %d micro-batches per step: bubble fraction %.3f",
                     pipeline["pipeline_stages"], pipeline["pipeline_microbatches"],
                     pipeline["pipeline_bubble"])
    # config.batch_size is the global batch: each process reads its share, rows
    # [i * b, (i + 1) * b) of each global batch (data.batches), which must be the rows that
    # its devices hold (the mesh orders devices by process).
    if jax.process_count() > 1:
        b, i = config.batch_size // jax.process_count(), jax.process_index()
        rows = parallel.process_batch_slice(plan.batch, (config.batch_size,))
        if rows != slice(i * b, (i + 1) * b):
            raise ValueError(f"process {i} of {jax.process_count()} holds rows {rows} of the "
                             f"global batch of {config.batch_size} under the mesh "
                             f"{dict(plan.mesh.shape)}, not its share [{i * b}:{(i + 1) * b}]: "
                             f"split the batch axis over the processes")
    train_iter = DataIterator(task.train, batch_size=config.batch_size // jax.process_count(),
                              seed=config.seed, process_index=jax.process_index(),
                              process_count=jax.process_count(),
                              worker_count=config.data_workers) if spec.batches is None else \
        spec.batches(task.train, config.batch_size // jax.process_count(),
                     process_index=jax.process_index(), process_count=jax.process_count())
    # Training metrics are logged as means over the logging interval; the open interval is
    # checkpointed with the iterator so that a resumed run logs the same means.
    interval = IntervalMean()

    def data_state(stopped_early=None):
        saved = {"iterator": train_iter.get_state(), "interval": interval.get_state()}
        # An early stop is part of the checkpoint: a run killed after it (while testing) and
        # restarted resumes as stopped, rather than training on past the target accuracy.
        if stopped_early is not None:
            saved["stopped_early_at"] = stopped_early
        return saved

    checkpointer = Checkpointer(workdir, keep=config.keep_checkpoints)
    stopped_early = None
    restored = checkpointer.restore_latest(state, plan.state)
    if restored is not None:
        state, saved = restored
        train_iter.set_state(saved["iterator"])
        interval.set_state(saved["interval"])
        stopped_early = saved.get("stopped_early_at")
        logging.info("resumed from step %d%s", int(state.step),
                     "" if stopped_early is None else " (stopped early: not training further)")
    else:
        state = plan.place_state(state)
    train_step = make_train_step(loss_fn, optimizer,
                                 num_microbatches=config.num_microbatches, loss_scale=loss_scale,
                                 sharding=plan, count_skipped=config.on_nonfinite == "skip")
    # Reads each step's faults where the loop waits for the device anyway, before anything is
    # logged, evaluated or saved: a non-finite or bad-data step stops the run (_guard.py).
    guard = Guard(config.on_nonfinite, config.max_consecutive_skips,
                  loss_scaled=loss_scale is not None)
    eval_step = make_eval_step(make_metrics_fn(task, policy, kind=config.model.kind,
                                               weights=config.loss), sharding=plan)
    writer = MetricWriter(workdir, tensorboard=config.tensorboard,
                          enabled=jax.process_index() == 0,
                          purge_step=None if restored is None else int(state.step) + 1)
    preemption = _Preemption()
    step, total = int(state.step), config.num_train_steps
    bar = ProgressBar(total, start=step,
                      enabled=config.progress_bar and jax.process_index() == 0)
    shown = {}
    validation = {}
    try:
        while step < total and stopped_early is None:
            state, metrics = train_step(state, plan.place_batch(next(train_iter)))
            step += 1
            faults = metrics.pop("faults")
            guard.add(step, faults, metrics)
            interval.add(metrics)
            if step % config.log_every == 0 or step == total:
                guard.check()
                rate = bar.rate()
                row = interval.mean()
                row["learning_rate"] = float(schedule(step - 1))
                writer.write(step, {f"train_{k}": v for k, v in row.items()}
                             | {"steps_per_second": rate})
                shown = {"loss": row["loss"], "acc": row["accuracy"]}
                logging.info("step %d/%d %.2f steps/s ETA %s loss %.4f acc %.3f", step, total,
                             rate, format_duration((total - step) / max(rate, 1e-9)),
                             row["loss"], row["accuracy"])
            bar.update(step, **shown)
            if step % config.eval_every == 0 or step == total:
                guard.check()
                validation = run_eval(eval_step, state.model, task.validation, config.batch_size)
                writer.write(step, {f"validation_{k}": v for k, v in validation.items()})
                bar.message(f"step {step}: validation loss {validation['loss']:.4f} "
                            f"accuracy {validation['accuracy']:.4f}")
                if step >= compression.best_from:  # pruning done: the final sparsity
                    checkpointer.save_best(step, state, data_state(), validation)
                if (config.stop_at_accuracy is not None
                        and validation["accuracy"] >= config.stop_at_accuracy):
                    stopped_early = step
                    bar.message(f"step {step}: validation accuracy reached "
                                f"{config.stop_at_accuracy}: stopping")
                    checkpointer.save(step, state, data_state(stopped_early), force=True)
                    break
            saved = step % config.checkpoint_every == 0 or step == total
            if saved:
                guard.check()
                checkpointer.save(step, state, data_state(), force=True)
            if on_step is not None:
                on_step(step)
            if preemption.stop(step) and step < total:
                logging.warning("preempted (SIGTERM): %s after step %d, saved to resume",
                                f"all {jax.process_count()} processes stop"
                                if preemption.several else "the run stops", step)
                if not saved:
                    guard.check()
                    checkpointer.save(step, state, data_state(), force=True)
                return {"preempted": True, "step": step}
        checkpointer.wait()
        if not validation:  # resumed with nothing left to train: the last state's figures
            validation = run_eval(eval_step, state.model, task.validation, config.batch_size)
        best = checkpointer.restore_best(state, plan.state)
        best_state = state if best is None else best[0]
        test = run_eval(eval_step, best_state.model, task.test, config.batch_size)
        writer.write(step, {f"test_{k}": v for k, v in test.items()})
        bar.close()
        result = {"step": step, "best_step": int(best_state.step), **pipeline}
        if stopped_early is not None:
            result["stopped_early_at"] = stopped_early
        result |= {f"validation_{k}": v for k, v in validation.items()}
        result |= {f"test_{k}": v for k, v in test.items()}
        result |= compression.finish(best_state.model, run_eval, eval_step, workdir)
        majority = _majority_accuracy(task)
        if majority is not None:
            result["test_majority_accuracy"] = majority
        logging.info("finished: %s", result)
        return result
    finally:
        bar.close()
        if hasattr(train_iter, "close"):
            train_iter.close()
        preemption.restore()
        checkpointer.wait()
        checkpointer.close()
        writer.close()
