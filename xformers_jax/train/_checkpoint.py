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
- ``checksums/``: a fingerprint of each array of ``state/`` (``_integrity.fingerprints``:
  computed on the devices before the save, 16 hex digits per tree path), written by orbax's
  JSON handler inside the same step, so it is committed with the arrays (orbax writes a step
  into a temporary directory and renames it when every item is written).

Restoring reads the newest step and checks it: its checksums are there, orbax's metadata
reads, every array reads and its fingerprint is the one saved. A step that fails (bytes
overwritten or cut off in an array file, ``_METADATA`` or ``manifest.ocdbt`` gone, an empty
step directory, no checksums) is reported with the reason and moved to
``<dir>.corrupt/<step>`` (kept to inspect; orbax would refuse to save that step again), and
the step before it is tried; when no step is intact the restore raises naming each step's
problem, and moves nothing. A template that does not match the stored tree is not corruption:
it raises at once (``parallel.restore_target``). Steps of an earlier version (no step of the
directory has checksums) restore unverified, with a warning.

Retention is the checkpointer's, not orbax's: orbax deletes the oldest steps when a new save
finishes even if the new one failed, so ``checkpoints/`` is trimmed to the newest ``keep``
steps only after a save has finished without error (at the next ``save`` or ``wait``): the
newest good step is never deleted in favour of one that did not make it to disk, and up to
``keep + 1`` steps exist while a save is in flight. ``best/`` keeps its best two: if the best
is found damaged, the next one is evaluated.

Saves are asynchronous; ``wait`` finishes them.
"""

from __future__ import annotations

import json
import os
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from ..parallel import checkpoint_tree, fill_arrays, restore_target
from ._integrity import fingerprints


def _copy(leaf):
    # The next jitted step donates the state's buffers while the asynchronous save may still
    # be writing. On the host when this process holds the whole array; arrays sharded across
    # processes are copied on their devices, each process writing its shards.
    if getattr(leaf, "is_fully_addressable", True):
        return np.array(leaf, copy=True)
    return jnp.copy(leaf)


def _handlers():
    # Registered up front so that item_metadata can read a step's tree before any restore.
    return {"state": ocp.StandardCheckpointHandler(),
            "data": grain.checkpoint.CheckpointHandler(),
            "checksums": ocp.JsonCheckpointHandler()}


class CheckpointCorrupt(RuntimeError):
    """No intact checkpoint to restore: every step of the directory failed its check."""


class _Damaged(Exception):
    """One step failed its check (the reason is the message)."""


def _reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) <= 300 else text[:300] + "..."


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
        raise FileNotFoundError(f"{directory} holds no data state (process_<i>-of-<n>.json)")
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
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        workdir = os.path.abspath(workdir)
        self.keep = keep
        # max_to_keep=None: orbax keeps every step, `_trim` deletes (see the module doc).
        self.latest = ocp.CheckpointManager(
            os.path.join(workdir, "checkpoints"), item_handlers=_handlers(),
            options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True))
        self.best_metric = best_metric
        # Its own barrier names: on several processes, a save to best/ and one to
        # checkpoints/ at the same step would otherwise meet at one barrier and fail.
        self.best = ocp.CheckpointManager(
            os.path.join(workdir, "best"), item_handlers=_handlers(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=2, create=True, best_fn=lambda m: m[best_metric],
                best_mode=best_mode,
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    barrier_sync_key_prefix="best")))

    @staticmethod
    def _args(state, data_state):
        tree = checkpoint_tree(state)
        sums = fingerprints(tree)  # of the arrays as they are, before the copy is written
        return ocp.args.Composite(state=ocp.args.StandardSave(jax.tree.map(_copy, tree)),
                                  data=grain.checkpoint.CheckpointSave(_DataState(data_state)),
                                  checksums=ocp.args.JsonSave({"fingerprints": sums}))

    def _trim(self) -> None:
        # After the last save finished without error (wait_until_finished raises otherwise):
        # every step on disk is one this run wrote or one verified (or older) at restore.
        for step in sorted(self.latest.all_steps())[:-self.keep]:
            self.latest.delete(step)

    def save(self, step: int, state, data_state: dict, *, force: bool = False) -> None:
        """Saves to ``checkpoints/`` at ``step`` (``force`` also when not on an interval)."""
        self.latest.wait_until_finished()
        self._trim()
        self.latest.save(step, args=self._args(state, data_state), force=force)

    def save_best(self, step: int, state, data_state: dict, metrics: dict) -> None:
        """Offers the step to ``best/``; orbax keeps it while it ranks among the best two.

        A run that stopped after evaluating a step but before its next ``checkpoints/`` save
        redoes that step on resume; resume is exact, so the state is the one ``best/`` already
        holds for it, and offering it again (which orbax refuses) is skipped."""
        if step in self.best.all_steps():
            return
        self.best.save(step, args=self._args(state, data_state),
                       metrics={self.best_metric: float(metrics[self.best_metric])}, force=True)

    @staticmethod
    def _has_checksums(manager, step) -> bool:
        return os.path.isdir(os.path.join(str(manager.directory), str(step), "checksums"))

    def _restore(self, manager, step, template, shardings, verify: bool):
        """``(state, data_state)`` of ``step``; ``_Damaged`` when the step fails its check."""
        where = os.path.join(str(manager.directory), str(step))
        if verify and not self._has_checksums(manager, step):
            raise _Damaged("no checksums/ (an interrupted or damaged save)")
        try:
            stored = manager.item_metadata(step)["state"].tree
            if not stored:
                raise ValueError("no arrays in its metadata")
            saved = (manager.restore(step, args=ocp.args.Composite(
                checksums=ocp.args.JsonRestore()))["checksums"]["fingerprints"]
                if verify else None)
        except Exception as e:  # whatever orbax raises on a damaged step
            raise _Damaged(f"its metadata or checksums do not read ({_reason(e)})") from e
        # The stored tree's paths, shapes and dtypes are checked against the template before
        # any array is read (a mismatch is the caller's, and raises); orbax then reads each
        # target shard's slice, whatever mesh wrote the checkpoint.
        target = restore_target(template, stored, shardings, os.path.join(where, "state"))
        earlier = os.path.join(where, "data", "metadata")
        try:
            if os.path.exists(earlier):
                # Written before the Grain pipeline: the data state is orbax's JSON item (which
                # DataIterator.set_state refuses by name: its batches are not Grain's).
                restored = manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target)))
                with open(earlier) as fh:
                    data_state = json.load(fh)
            else:
                restored = manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target)))
                data_state = None
        except Exception as e:
            raise _Damaged(f"its arrays or data state do not read ({_reason(e)})") from e
        if data_state is None:
            try:
                data_state = _read_data_state(manager.directory / str(step) / "data")
            except (OSError, json.JSONDecodeError) as e:  # states that differ raise ValueError
                raise _Damaged(f"its data state does not read ({_reason(e)})") from e
        if verify:
            got = fingerprints(restored["state"])
            bad = sorted(p for p in set(got) | set(saved) if got.get(p) != saved.get(p))
            if bad:
                raise _Damaged(f"{len(bad)} array(s) differ from their checksums, first "
                               f"{bad[0]!r} (saved {saved.get(bad[0])}, read {got.get(bad[0])})")
        return fill_arrays(template, restored["state"]), data_state

    def _restore_intact(self, manager, steps, template, shardings, what: str):
        """The first of ``steps`` that passes its check; damaged ones before it are reported
        and moved aside. ``CheckpointCorrupt`` when none passes (nothing is moved)."""
        verify = any(self._has_checksums(manager, s) for s in steps)
        if steps and not verify:
            logging.warning("%s: written without checksums (an earlier version): restoring "
                            "step %d unverified", manager.directory, steps[0])
        damaged = []
        for step in steps:
            try:
                out = self._restore(manager, step, template, shardings, verify)
            except _Damaged as e:
                damaged.append((step, str(e)))
                continue
            for bad, why in damaged:
                moved = self._move_aside(manager, bad)
                logging.warning("%s step %d is damaged (%s): moved to %s; resuming from step "
                                "%d", what, bad, why, moved, step)
            if damaged:
                manager.reload()
            return out
        if damaged:
            lines = "; ".join(f"step {s}: {why}" for s, why in damaged)
            raise CheckpointCorrupt(
                f"no intact checkpoint in {manager.directory}: {lines}. Nothing was moved; "
                "move the damaged steps away (or use another workdir) to start afresh")
        return None

    @staticmethod
    def _move_aside(manager, step) -> str:
        if jax.process_index() != 0:
            return "(by process 0)"
        directory = str(manager.directory)
        aside = os.path.join(directory + ".corrupt", f"{step}.{time.strftime('%Y%m%d-%H%M%S')}")
        os.makedirs(os.path.dirname(aside), exist_ok=True)
        os.rename(os.path.join(directory, str(step)), aside)
        return aside

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

        Each step is checked before it is returned (see the module doc): a damaged latest
        step is reported and moved aside and the one before it restored; ``CheckpointCorrupt``
        when no step is intact.
        """
        steps = sorted(self.latest.all_steps(), reverse=True)
        return self._restore_intact(self.latest, steps, template, shardings, "checkpoint")

    def restore_best(self, template, shardings=None):
        """``(state, data_state)`` of the best intact checkpoint, or None when there is none
        (checked as ``restore_latest``; a damaged best is moved aside and the next best
        read)."""
        best = self.best.best_step()
        steps = [] if best is None else [best] + sorted(
            (s for s in self.best.all_steps() if s != best), reverse=True)
        return self._restore_intact(self.best, steps, template, shardings, "best checkpoint")

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are written (then trims ``checkpoints/``)."""
        self.latest.wait_until_finished()
        self._trim()
        self.best.wait_until_finished()

    def close(self) -> None:
        self.latest.close()
        self.best.close()
