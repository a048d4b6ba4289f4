"""Multi-host set-up: ``jax.distributed.initialize`` from the environment, per-process data.

On a TPU pod slice or a SLURM/Open MPI cluster, ``jax.distributed.initialize()`` finds the
coordinator by itself; elsewhere (several GPU hosts) set ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` on every host. Each process then loads only the
rows of the global batch that its own devices hold.
"""

from __future__ import annotations

import os

import jax
import numpy as np

_AUTO = ("TPU_WORKER_HOSTNAMES", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")


def initialize_from_env(environ=None) -> bool:
    """Calls ``jax.distributed.initialize`` when the environment describes several processes.

    Uses ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` (and
    ``JAX_LOCAL_DEVICE_IDS``, comma separated) when set; otherwise auto-detection when a TPU
    pod, SLURM or Open MPI variable is present. Must run before anything touches devices.

    Returns:
      True if it initialised the distributed runtime, False on a single host.
    """
    env = os.environ if environ is None else environ
    if "JAX_COORDINATOR_ADDRESS" in env:
        local = env.get("JAX_LOCAL_DEVICE_IDS")
        jax.distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env["JAX_NUM_PROCESSES"]),
            process_id=int(env["JAX_PROCESS_ID"]),
            local_device_ids=[int(i) for i in local.split(",")] if local else None,
        )
        return True
    if any(k in env for k in _AUTO):
        jax.distributed.initialize()
        return True
    return False


def process_batch_slice(sharding, global_shape) -> slice:
    """The rows (axis 0) of a global batch that this process's devices hold under ``sharding``.

    Every process loads ``global_batch[process_batch_slice(...)]`` and builds the global array
    with :func:`global_batch`. Raises ``ValueError`` if this process's rows are not contiguous.
    """
    rows = set()
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        start, stop, _ = index[0].indices(global_shape[0])
        rows.update(range(start, stop))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise ValueError(f"process_batch_slice: this process's rows {sorted(rows)} are not contiguous")
    return slice(lo, hi)


def global_batch(local_rows, sharding, global_shape):
    """The global ``jax.Array`` from each process's rows ``[process_batch_slice(...)]``."""
    return jax.make_array_from_process_local_data(sharding, np.asarray(local_rows), tuple(global_shape))
