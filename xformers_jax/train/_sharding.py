"""The trainer's mesh and shardings, from ``config.mesh`` and ``config.sharding``.

``config.mesh`` gives the mesh axis sizes (``{"data": -1}``, the default, is data parallelism
over every device: ``-1`` fills) or a strategy (``{"strategy": "fsdp+sequence"}``, see
``parallel.strategy``). ``config.sharding`` holds the ordered logical->mesh rules for
parameters and for compute (empty: ``parallel.DEFAULT_*_RULES``). Parameters get the shardings
their fields declare (``xformers_jax.axes.param``) and Adam's moments their parameter's (FSDP
shards both); the rest of the train state is replicated, batches are split on their leading
axis, and the step is a ``jax.jit`` with these in/out shardings traced inside
``parallel.use_mesh`` so the models' activation annotations and sequence-parallel attention
apply. One device is an ordinary plan (a one-device mesh): there is one path.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import parallel
from .. import axes as A
from ._optim import trainable
from ._state import TrainState

def resolve_mesh(mesh_config) -> dict[str, int]:
    """Mesh axis sizes for ``config.mesh`` over this run's devices.

    Sizes whose product is less than the device count (with no ``-1``) use the first devices
    only (one process): ``{"data": 1}`` trains on one device.
    """
    sizes = dict(mesh_config)
    name = sizes.pop("strategy", None)
    n = jax.device_count()
    if name:
        return parallel.strategy(name, sizes, n).mesh_shape
    if -1 not in sizes.values() and math.prod(sizes.values()) < n and jax.process_count() == 1:
        n = math.prod(sizes.values())
    return parallel.resolve_mesh_shape(sizes, n)


class ShardingPlan(NamedTuple):
    """The mesh, the rules and the train state's / batches' shardings for one run."""

    mesh: Mesh
    compute_rules: tuple
    param_rules: tuple
    state: TrainState  # a NamedSharding per array of the state (None elsewhere)
    batch: NamedSharding

    @property
    def batch_shards(self) -> int:
        """How many pieces the leading (batch) axis is split into."""
        spec = self.batch.spec[0] if self.batch.spec else None
        axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
        return math.prod(self.mesh.shape[a] for a in axes)

    @property
    def sequence_shards(self) -> int:
        """How many pieces the ``sequence`` mesh axis splits each sequence into."""
        return self.mesh.shape.get(A.SEQUENCE, 1)

    def pipeline_report(self, step_batch: int) -> dict:
        """With a ``stage`` mesh axis of ``S > 1`` (the layer stacks run as GPipe pipelines):
        ``pipeline_stages``, ``pipeline_microbatches`` (``M``, as the stack picks them for a
        step over ``step_batch`` rows) and ``pipeline_bubble``, the fraction ``(S - 1) /
        (M + S - 1)`` of each device's ticks spent idle. Empty without a pipeline."""
        stages = self.mesh.shape.get(A.STAGE, 1)
        if stages == 1:
            return {}
        m = parallel.microbatches_for(step_batch, stages)
        return {"pipeline_stages": stages, "pipeline_microbatches": m,
                "pipeline_bubble": parallel.bubble_fraction(stages, m)}

    def context(self):
        """``parallel.use_mesh`` with this plan's mesh and rules (open it around tracing)."""
        return parallel.use_mesh(self.mesh, self.compute_rules, self.param_rules)

    def place_state(self, state):
        arrays, static = eqx.partition(state, eqx.is_array)
        return eqx.combine(jax.device_put(arrays, self.state), static)

    def place_batch(self, batch):
        """Each process's rows of the global batch -> one global array per leaf."""
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch, np.asarray(x)), batch)


def make_sharding_plan(config, state: TrainState, optimizer) -> ShardingPlan:
    """The plan for ``config.mesh`` / ``config.sharding`` (a one-device mesh included)."""
    shape = resolve_mesh(config.mesh)
    mesh = parallel.make_mesh(shape, jax.devices()[:math.prod(shape.values())])
    s = config.sharding
    param_rules = tuple(s.param_rules) or parallel.DEFAULT_PARAM_RULES
    compute_rules = tuple(s.compute_rules) or parallel.DEFAULT_COMPUTE_RULES
    replicated = NamedSharding(mesh, P())
    model = parallel.param_shardings(state.model, param_rules, mesh)
    trained = parallel.param_shardings(trainable(state.model), param_rules, mesh)
    opt = parallel.optimizer_shardings(optimizer, state.opt_state, trained, mesh)
    shardings = TrainState(
        step=replicated, model=model, opt_state=opt, key=replicated,
        loss_scale=jax.tree.map(lambda _: replicated, state.loss_scale),
        carry=jax.tree.map(lambda _: replicated, state.carry))
    batch = parallel.logical_sharding((A.BATCH,), compute_rules, mesh)
    return ShardingPlan(mesh, compute_rules, param_rules, shardings, batch)
