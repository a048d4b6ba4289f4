"""Runs for studies and sweeps: train a config unless it has finished, and read what runs logged.

A study trains each of its runs in ``WORKDIR/NAME`` with :func:`run_or_resume`::

  record = run_lib.run_or_resume(config, os.path.join(workdir, "teacher_s0"),
                                 tags=dict(method="teacher", seed=0))

- a finished run (its :data:`RESULT` file exists) is not trained again: its record is read back;
- an interrupted one (checkpoints but no result file) resumes from its latest checkpoint (the
  trainer's own resume, exact; ``resumed_from`` records the step);
- a finished run's record is written atomically (a temporary file renamed over ``RESULT``)
  only after ``train_and_evaluate`` returned its final metrics: a run that raised, or was
  preempted (SIGTERM: a checkpoint is saved and :class:`Preempted` raised), leaves none, so
  the next call resumes it.

The record: the ``tags`` given, ``steps`` (the config's), ``resumed_from``, ``seconds`` (wall
time of this call's training), ``load_start`` / ``load_end`` (the 1-minute load average: the
machine is shared), ``cpu`` and ``cores``, ``result`` (the trainer's scalar metrics) and what
``summarize(workdir)`` adds.

Table scripts read a run's ``metrics.jsonl`` (one JSON row per logging step, written by the
trainer; :func:`xformers_jax.train.read_jsonl` reads it) through :func:`read_metrics` and take
values with :func:`last` (a key's last value), :func:`latest` (every key's last value),
:func:`last_row` (the last row holding a key) and :func:`series` (``{step: value}``; a
resumed run's repeated steps keep their last value).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable

import numpy as np

RESULT = "result.json"
METRICS = "metrics.jsonl"


class Preempted(RuntimeError):
    """The trainer was asked to stop (SIGTERM): it saved a checkpoint, the run has no result;
    running it again resumes it."""


def load_average() -> float:
    """The 1-minute load average (what else the shared machine was running)."""
    return os.getloadavg()[0]


def finished(workdir: str) -> dict | None:
    """The record of a finished run in ``workdir``, or None."""
    path = os.path.join(workdir, RESULT)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def latest_checkpoint(workdir: str) -> int:
    """The step of the latest checkpoint in ``workdir/checkpoints`` (0 when there is none)."""
    path = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(path):
        return 0
    return max((int(s) for s in os.listdir(path) if s.isdigit()), default=0)


def _write_atomic(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_or_resume(config, workdir: str, *, tags: dict | None = None,
                  summarize: Callable[[str], dict] | None = None, on_step=None) -> dict:
    """Trains ``config`` in ``workdir`` unless it has finished; returns the run's record.

    Args:
      config: the run's locked trainer config.
      workdir: the run's directory (``WORKDIR/NAME``).
      tags: fields that name the run in its record (``method``, ``seed``, ...).
      summarize: ``summarize(workdir) -> dict`` adds fields computed from the finished run
        (e.g. time per step from its ``metrics.jsonl``).
      on_step: passed to ``train_and_evaluate`` (tests interrupt a run with it).

    Raises:
      Preempted: the trainer stopped on SIGTERM (checkpoint saved, no result).
    """
    done = finished(workdir)
    if done is not None:
        return done
    from xformers_jax import train  # here: reading a record or metrics needs no trainer
    from xformers_jax_experiments import bench_lib

    resumed_from = latest_checkpoint(workdir)
    load_start, start = load_average(), time.time()
    result = train.train_and_evaluate(config, workdir, on_step=on_step)
    if result.get("preempted"):
        raise Preempted(f"{workdir}: preempted at step {result['step']}; checkpoint saved, run "
                        "again to resume")
    machine = bench_lib.machine_info()
    record = dict(tags or {})
    record.update(steps=config.num_train_steps, resumed_from=resumed_from,
                  seconds=round(time.time() - start, 1), load_start=load_start,
                  load_end=load_average(), cpu=machine["cpu"], cores=machine["cores"],
                  result={k: v for k, v in result.items() if np.isscalar(v)})
    if summarize is not None:
        record.update(summarize(workdir))
    _write_atomic(os.path.join(workdir, RESULT), record)
    return record


def read_metrics(workdir: str, *, missing_ok: bool = False) -> list[dict]:
    """The rows of ``workdir/metrics.jsonl`` in the order they were logged (``[]`` for a run
    that wrote none when ``missing_ok``)."""
    from xformers_jax.train import read_jsonl

    path = os.path.join(workdir, METRICS)
    if missing_ok and not os.path.exists(path):
        return []
    return read_jsonl(path)


def last(rows: list[dict], key: str, default=None):
    """The last logged value of ``key`` (``default`` when no row holds it)."""
    for row in reversed(rows):
        if key in row:
            return row[key]
    return default


def latest(rows: list[dict], keys: Iterable[str] | Callable[[str], bool] | None = None) -> dict:
    """Every key's last logged value: all keys, those in ``keys``, or those ``keys(key)``
    accepts."""
    if isinstance(keys, str):
        keys = (keys,)
    if keys is not None and not callable(keys):
        keys = frozenset(keys).__contains__
    out = {}
    for row in rows:
        out.update({k: v for k, v in row.items() if keys is None or keys(k)})
    return out


def last_row(rows: list[dict], key: str) -> dict | None:
    """The last row that holds ``key`` (its other values were logged with it), or None."""
    for row in reversed(rows):
        if key in row:
            return row
    return None


def series(rows: list[dict], key: str) -> dict[int, float]:
    """``{step: value}`` of ``key`` in step order; a step logged twice (a resumed run redoes
    the steps after its last checkpoint) keeps its last value."""
    points = {}
    for row in rows:
        if key in row:
            points[row["step"]] = row[key]
    return dict(sorted(points.items()))


def final_step(rows: list[dict]) -> int:
    """The last step a run logged."""
    return max(row["step"] for row in rows)
