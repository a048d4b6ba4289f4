"""Orbax checkpoints of the train state and the data iterator: last N, and the best.

Two ``CheckpointManager``s under ``workdir``: ``checkpoints/`` keeps the last ``keep`` steps
(resume picks the latest), ``best/`` keeps the one with the best validation metric (the final
test evaluation reads it). Each step directory ``<step>/`` holds two items:

- ``state/``: the train state's arrays keyed by tree path (``step``, ``model/...``,
  ``opt_state/0/mu/...``, ``key``), the format of :func:`xformers_jax.parallel.save_checkpoint`
  and by the same code (``parallel.checkpoint_tree``, ``restore_target``, ``fill_arrays``):
  restoring checks the stored paths, shapes and dtypes against the template first and names
  the first difference; ``parallel.checkpoint_contents`` lists it and ``parallel.restore_checkpoint(..., prefix="model")`` reads
  a part of it. Index-keyed checkpoints of earlier versions fail with a pointer to
  ``parallel.convert_index_checkpoint`` (which converts a whole ``workdir``).
- ``data/``: the input's state, one JSON file per process (``process_<i>-of-<n>.json``),
  written by Grain's own orbax handler (``grain.checkpoint.CheckpointHandler``): the
  trainer's Grain iterator state (``DataIterator.get_state``) and the open logging
  interval's sums, so that a resumed run reads the batches and logs the means it would have.
  Both are positions in the global batches and means of global values, the same on every
  process, so a run resumes on any process count: each process reads its own file when the
  count is the same and otherwise any file, after checking that they all agree.

Saves are asynchronous; ``wait`` finishes them.
"""

from __future__ import annotations

import json
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from ..parallel import checkpoint_tree, fill_arrays, restore_target


def _copy(leaf):
    # The next jitted step donates the state's buffers while the asynchronous save may still
    # be writing. On the host when this process holds the whole array; arrays sharded across
    # processes are copied on their devices, each process writing its shards.
    if getattr(leaf, "is_fully_addressable", True):
        return np.array(leaf, copy=True)
    return jnp.copy(leaf)


def _handlers():
    # Registered up front so that item_metadata can read a step's tree before any restore.
    return dict(state=ocp.StandardCheckpointHandler(),
                data=grain.checkpoint.CheckpointHandler())


class _DataState(grain.DatasetIterator):
    """A data state dict in the form Grain's checkpoint handler saves: an iterator whose
    state it is (the handler writes ``get_state()`` of each process as JSON;
    ``_read_data_state`` reads it back)."""

    def __init__(self, state=None):
        super().__init__()
        self.state = state

    def __next__(self):
        raise TypeError("a checkpointed data state, not an iterator to read")

    def get_state(self) -> dict:
        return self.state

    def set_state(self, state: dict) -> None:
        self.state = state


def _read_data_state(directory) -> dict:
    """The data state Grain's handler wrote (``process_<i>-of-<n>.json`` under ``directory``,
    an ``epath.Path``), for this process whatever the process count ``n`` of the run that
    wrote it: the states are positions in the global batches, so every file holds the same."""
    own = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    if own.exists():
        return json.loads(own.read_text())
    files = sorted(p for p in directory.iterdir() if p.name.startswith("process_"))
    if not files:
        raise ValueError(f"{directory} holds no data state (process_<i>-of-<n>.json)")
    states = [json.loads(p.read_text()) for p in files]
    if any(s != states[0] for s in states):
        raise ValueError(f"{directory}: the data states of {[p.name for p in files]} differ, "
                         f"so the run cannot resume on {jax.process_count()} processes; "
                         f"resume it on the process count that wrote it")
    return states[0]


class Checkpointer:
    """Saves and restores ``(TrainState, iterator state)`` pairs.

    Args:
      workdir: the run's directory.
      keep: how many of the latest checkpoints to keep.
      best_metric, best_mode: the validation metric ranking ``best/`` ("max" or "min").
    """

    def __init__(self, workdir: str, *, keep: int = 3, best_metric: str = "accuracy",
                 best_mode: str = "max"):
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
        workdir = os.path.abspath(workdir)
        self.latest = ocp.CheckpointManager(
            os.path.join(workdir, "checkpoints"), item_handlers=_handlers(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))
        self.best_metric = best_metric
        # Its own barrier names: on several processes, a save to best/ and one to
        # checkpoints/ at the same step would otherwise meet at one barrier and fail.
        self.best = ocp.CheckpointManager(
            os.path.join(workdir, "best"), item_handlers=_handlers(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=1, create=True, best_fn=lambda m: m[best_metric],
                best_mode=best_mode,
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    barrier_sync_key_prefix="best")))

    @staticmethod
    def _args(state, data_state):
        tree = jax.tree.map(_copy, checkpoint_tree(state))
        return ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                  data=grain.checkpoint.CheckpointSave(_DataState(data_state)))

    def save(self, step: int, state, data_state: dict, *, force: bool = False) -> None:
        """Saves to ``checkpoints/`` at ``step`` (``force`` also when not on an interval)."""
        self.latest.save(step, args=self._args(state, data_state), force=force)

    def save_best(self, step: int, state, data_state: dict, metrics: dict) -> None:
        """Offers the step to ``best/``; orbax keeps it only while it ranks best.

        A run that stopped after evaluating a step but before its next ``checkpoints/`` save
        redoes that step on resume; resume is exact, so the state is the one ``best/`` already
        holds for it, and offering it again (which orbax refuses) is skipped."""
        if step in self.best.all_steps():
            return
        self.best.save(step, args=self._args(state, data_state),
                       metrics={self.best_metric: float(metrics[self.best_metric])}, force=True)

    def _restore(self, manager, step, template, shardings):
        # The stored tree's paths, shapes and dtypes are checked against the template before
        # any array is read; orbax then reads each target shard's slice, whatever mesh wrote
        # the checkpoint.
        stored = manager.item_metadata(step)["state"].tree
        where = os.path.join(str(manager.directory), str(step), "state")
        target = restore_target(template, stored, shardings, where)
        earlier = os.path.join(str(manager.directory), str(step), "data", "metadata")
        if os.path.exists(earlier):
            # Written before the Grain pipeline: the data state is orbax's JSON item (which
            # DataIterator.set_state refuses by name: its batches are not Grain's).
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target)))
            with open(earlier) as fh:
                return fill_arrays(template, restored["state"]), json.load(fh)
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target)))
        return fill_arrays(template, restored["state"]), _read_data_state(
            manager.directory / str(step) / "data")

    def latest_step(self) -> int | None:
        return self.latest.latest_step()

    def restore_latest(self, template, shardings=None):
        """``(state, data_state)`` from the latest checkpoint, or None when there is none.

        ``template`` is a state of the same structure (e.g. a freshly initialised one, or
        ``jax.eval_shape`` of one); arrays are matched by tree path, and a template whose
        paths, shapes or dtypes differ from the checkpoint's raises ``ValueError`` naming the
        first difference before anything is read. ``shardings`` (a ``NamedSharding`` per
        array of it, e.g. ``ShardingPlan.state``, or one for all) places the restored arrays,
        on any mesh (default: one local device).
        """
        step = self.latest.latest_step()
        return None if step is None else self._restore(self.latest, step, template, shardings)

    def restore_best(self, template, shardings=None):
        """``(state, data_state)`` of the best checkpoint, or None when there is none."""
        step = self.best.best_step()
        return None if step is None else self._restore(self.best, step, template, shardings)

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are written."""
        self.latest.wait_until_finished()
        self.best.wait_until_finished()

    def close(self) -> None:
        self.latest.close()
        self.best.close()
