"""Metrics to JSONL (always) and TensorBoard event files (through tensorboardX).

``metrics.jsonl`` is the record the project's own tools read (``read_jsonl``,
``xformers_jax_experiments/plot.py``). The event files are written by tensorboardX's ``SummaryWriter``
(no TensorFlow or PyTorch needed), so TensorBoard's readers see what the JSONL holds: one
scalar per tag per row, at the row's step.

``IntervalMean`` averages the training metrics over a logging interval (as big_vision and
MaxText log them) without waiting for the device at every step.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import sys

import jax
import numpy as np

_SUFFIX = itertools.count()


def _summary_writer_class():
    # Imported on first use: a run with tensorboard=False does not need the package.
    # tensorboardX imports PyTorch at import time when it is installed (to accept torch
    # tensors: the trainer gives it floats), which costs seconds and hundreds of MB; unless
    # torch is loaded already, it is hidden from that import (a None entry in sys.modules
    # makes `import torch` raise ImportError, which tensorboardX catches).
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricWriter:
    """Appends ``{"step", name: value, ...}`` lines to ``metrics.jsonl`` and scalar summaries
    to ``events.out.tfevents.*`` under ``workdir`` (``tensorboard=False`` skips the latter).

    ``enabled=False`` makes every call a no-op and creates no file: on a pod every host computes
    the same global metrics, and only process 0 should write them to the shared workdir
    (the trainer passes ``enabled=jax.process_index() == 0``).

    ``purge_step``: the first step a run resumed from a checkpoint writes (the checkpoint's
    step + 1); TensorBoard then hides the events of earlier runs at steps ``>= purge_step``
    (the steps this run redoes), as a reader of the JSONL keeps the last row per step.
    """

    def __init__(self, workdir: str, *, tensorboard: bool = True, enabled: bool = True,
                 purge_step: int | None = None):
        self.enabled = enabled
        self._jsonl = self._summary = None
        self.events_path = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self.jsonl_path = os.path.join(workdir, "metrics.jsonl")
        self._jsonl = open(self.jsonl_path, "a")
        if tensorboard:
            SummaryWriter = _summary_writer_class()
            # One file per writer: tensorboardX names files by the second and the host, and
            # opens them for writing, so a restart within the same second would overwrite.
            suffix = f".{os.getpid()}.{next(_SUFFIX)}"
            self._summary = SummaryWriter(logdir=workdir, filename_suffix=suffix,
                                          purge_step=purge_step, flush_secs=10)
            pattern = os.path.join(workdir, f"events.out.tfevents.*{suffix}")
            (self.events_path,) = glob.glob(pattern)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Writes one row; values become Python floats (numpy / JAX scalars accepted)."""
        if not self.enabled:
            return
        values = {k: float(np.asarray(v)) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": int(step), **values}) + "\n")
        self._jsonl.flush()
        if self._summary is not None:
            for tag, value in values.items():
                self._summary.add_scalar(tag, value, int(step))

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        if self._summary is not None:
            self._summary.close()


class IntervalMean:
    """The mean of each training metric over the steps since the last logged row.

    ``add(metrics)`` keeps the step's metrics as they are (device scalars: no wait for the
    step to finish, so the host can prepare the next batch while the device computes);
    ``mean()`` reads them, in step order, and starts a new interval. Sums are float64 sums in
    step order, so a run resumed with ``set_state(get_state())`` logs the same means as one
    that never stopped.
    """

    def __init__(self):
        self._pending, self._sums, self._count = [], {}, 0

    def add(self, metrics: dict) -> None:
        self._pending.append(metrics)

    def _fold(self) -> None:
        for metrics in jax.device_get(self._pending):
            for k, v in metrics.items():
                self._sums[k] = self._sums.get(k, 0.0) + float(np.asarray(v))
            self._count += 1
        self._pending = []

    def mean(self) -> dict[str, float]:
        """``{name: mean over the interval}``; the next interval starts empty."""
        self._fold()
        out = {k: v / self._count for k, v in self._sums.items()} if self._count else {}
        self._sums, self._count = {}, 0
        return out

    def get_state(self) -> dict:
        """The open interval's sums and count (JSON-serialisable, exact)."""
        self._fold()
        return {"sums": dict(self._sums), "count": self._count}

    def set_state(self, state: dict) -> None:
        self._pending = []
        self._sums = {k: float(v) for k, v in state["sums"].items()}
        self._count = int(state["count"])


def read_jsonl(path: str) -> list[dict]:
    """The rows of a metrics.jsonl file."""
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
