"""Orbax checkpoints of the train state and the data iterator: last N, and the best.

Two ``CheckpointManager``s under ``workdir``: ``checkpoints/`` keeps the last ``keep`` steps
(resume picks the latest), ``best/`` keeps the one with the best validation metric (the final
test evaluation reads it). Each checkpoint holds the state's arrays and the iterator's
``{"epoch", "position", "seed"}`` as JSON. Saves are asynchronous; ``wait`` finishes them.
"""

from __future__ import annotations

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


def _arrays(state):
    arrays, static = eqx.partition(state, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    return leaves, treedef, static


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
            os.path.join(workdir, "checkpoints"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))
        self.best_metric = best_metric
        self.best = ocp.CheckpointManager(
            os.path.join(workdir, "best"),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=1, create=True, best_fn=lambda m: m[best_metric],
                best_mode=best_mode))

    @staticmethod
    def _args(state, data_state):
        leaves, _, _ = _arrays(state)
        # Copies: the next jitted step donates the state's buffers while the asynchronous save
        # may still be writing. On the host when this process holds the whole array; arrays
        # sharded across processes are copied on their devices, each process writing its
        # shards.
        tree = {str(i): np.array(leaf, copy=True) if leaf.is_fully_addressable
                else jnp.copy(leaf) for i, leaf in enumerate(leaves)}
        return ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                  data=ocp.args.JsonSave(dict(data_state)))

    def save(self, step: int, state, data_state: dict, *, force: bool = False) -> None:
        """Saves to ``checkpoints/`` at ``step`` (``force`` also when not on an interval)."""
        self.latest.save(step, args=self._args(state, data_state), force=force)

    def save_best(self, step: int, state, data_state: dict, metrics: dict) -> None:
        """Offers the step to ``best/``; orbax keeps it only while it ranks best."""
        self.best.save(step, args=self._args(state, data_state),
                       metrics={self.best_metric: float(metrics[self.best_metric])}, force=True)

    def _restore(self, manager, step, template, shardings):
        leaves, treedef, static = _arrays(template)
        targets = ([None] * len(leaves) if shardings is None else jax.tree.leaves(
            shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)))
        # Orbax reads each target shard's slice, whatever mesh wrote the checkpoint.
        abstract = {str(i): jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)
                    for i, (x, s) in enumerate(zip(leaves, targets, strict=True))}
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        arrays = [restored["state"][str(i)] for i in range(len(leaves))]
        return eqx.combine(jax.tree.unflatten(treedef, arrays), static), dict(restored["data"])

    def latest_step(self) -> int | None:
        return self.latest.latest_step()

    def restore_latest(self, template, shardings=None):
        """``(state, data_state)`` from the latest checkpoint, or None when there is none.

        ``template`` is a state of the same structure (e.g. a freshly initialised one);
        ``shardings`` (a ``NamedSharding`` per array of it, e.g. ``ShardingPlan.state``)
        places the restored arrays, on any mesh (default: one device).
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
