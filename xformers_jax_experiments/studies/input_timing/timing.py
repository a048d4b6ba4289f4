"""Is the input pipeline on the critical path? The main job's train step timed with the Grain
pipeline feeding it and with one batch already on the device, in alternating rounds.

  python -m xformers_jax_experiments.studies.input_timing.timing
      [--timing_config=xformers_jax_experiments/configs/lra/listops.py:performer,main]
      [--timing_steps=20] [--timing_rounds=10]

(Flag names carry the module's prefix: absl flags are global, and ``--config``/``--steps``
are other scripts' flags.)

Prints per-step milliseconds, wall and process CPU time (median and minimum over rounds), of:
the step fed by ``DataIterator`` as the trainer feeds it (``plan.place_batch(next(it))``), the
step on a fixed placed batch, and ``next(it)`` alone (with the read-ahead thread, and read
synchronously).
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from xformers_jax import train
from xformers_jax.data import DataIterator

_CONFIG = config_flags.DEFINE_config_file(
    "timing_config", "xformers_jax_experiments/configs/lra/listops.py:performer,main",
    "The job's config.")
_STEPS = flags.DEFINE_integer("timing_steps", 20, "Steps per round.")
_ROUNDS = flags.DEFINE_integer("timing_rounds", 10, "Alternating rounds.")


def _timed(fn, steps):
    """(wall, process CPU) milliseconds per call; CPU time counts every thread of this
    process (XLA's and the read-ahead thread), so it is less moved by other processes."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        out = fn()
    jax.block_until_ready(out)
    return ((time.perf_counter() - start) / steps * 1e3,
            (time.process_time() - cpu) / steps * 1e3)


def main(argv):
    del argv
    config = _CONFIG.value
    task = train.make_task(config.data, config.seed)
    model = train.build_model(config.model, task, jax.random.PRNGKey(0))
    o = config.optim
    schedule = train.make_schedule(o.schedule, learning_rate=o.learning_rate,
                                   warmup_steps=o.warmup_steps,
                                   total_steps=config.num_train_steps)
    optimizer = train.make_optimizer(schedule, weight_decay=o.weight_decay,
                                     grad_clip_norm=o.grad_clip_norm, b1=o.b1, b2=o.b2)
    state = train.create_train_state(model, optimizer, jax.random.PRNGKey(1))
    plan = train.make_sharding_plan(config, state, optimizer)
    state = plan.place_state(state)
    step = train.make_train_step(train.make_loss_fn(task), optimizer,
                                 num_microbatches=config.num_microbatches, sharding=plan)
    it = DataIterator(task.train, batch_size=config.batch_size, seed=config.seed)
    sync = DataIterator(task.train, batch_size=config.batch_size, seed=config.seed, prefetch=0)
    fixed = plan.place_batch(next(it))
    box = [state]

    def fed():
        box[0], metrics = step(box[0], plan.place_batch(next(it)))
        return metrics

    def unfed():
        box[0], metrics = step(box[0], fixed)
        return metrics

    for _ in range(5):  # compile and warm up
        fed(), unfed()
    jax.block_until_ready(box[0])
    times = {"step fed by the pipeline": [], "step on a fixed batch": [],
             "next(it), read-ahead thread": [], "next(it), synchronous": []}
    for _ in range(_ROUNDS.value):
        times["step fed by the pipeline"].append(_timed(fed, _STEPS.value))
        times["step on a fixed batch"].append(_timed(unfed, _STEPS.value))
        times["next(it), read-ahead thread"].append(_timed(lambda: next(it), _STEPS.value))
        times["next(it), synchronous"].append(_timed(lambda: next(sync), _STEPS.value))
    for name, values in times.items():
        wall, cpu = np.array(values).T
        print(f"{name:30s} wall {np.median(wall):8.2f} ms (min {wall.min():.2f})  "
              f"CPU {np.median(cpu):8.2f} ms (min {cpu.min():.2f})  per step, "
              f"{len(values)} rounds")
    it.close()
    sync.close()


if __name__ == "__main__":
    app.run(main)
