"""Orbax checkpoints of sharded state that restore onto any mesh.

The arrays of a state (an Equinox module, optax state, any pytree) are saved as a flat list by
``orbax.checkpoint.StandardCheckpointer``: each process writes the shards it holds (one process
on a single host). Restoring takes a ``like`` state and target shardings, so a state saved on
a ``(4, 2)`` mesh can be read onto a ``(2, 4)`` mesh or one device: orbax reads each target
shard's slice of the stored array.
"""

from __future__ import annotations

import os

import equinox as eqx
import jax
import orbax.checkpoint as ocp


def _arrays(tree):
    return jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))


def save_checkpoint(directory: str, state) -> None:
    """Saves the array leaves of ``state`` under ``directory`` (which must not exist yet)."""
    leaves = _arrays(state)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(directory), {f"{i:05d}": x for i, x in enumerate(leaves)})
        ckpt.wait_until_finished()


def restore_checkpoint(directory: str, like, shardings=None):
    """Restores a state saved by :func:`save_checkpoint` with the structure of ``like``.

    Args:
      directory: where it was saved.
      like: a state of the same structure (e.g. freshly initialised, or ``jax.eval_shape``
        of the initialiser); only its array shapes/dtypes and its static parts are used.
      shardings: a pytree of shardings for ``like``'s arrays (as :func:`param_shardings`
        gives, or any prefix-compatible tree of one per array); default: one device.

    Returns:
      ``like`` with every array replaced by the stored one, placed with ``shardings``.
    """
    arrays, static = eqx.partition(like, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(arrays)
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        targets = [device] * len(leaves)
    else:
        targets = jax.tree_util.tree_leaves(
            shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
        )
    if len(targets) != len(leaves):
        raise ValueError(
            f"restore_checkpoint: {len(targets)} shardings for {len(leaves)} arrays"
        )
    abstract = {
        f"{i:05d}": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        for i, (x, s) in enumerate(zip(leaves, targets))
    }
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(os.path.abspath(directory), abstract)
    values = [restored[f"{i:05d}"] for i in range(len(leaves))]
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, values), static)
