"""Sharding across device meshes: data, FSDP, tensor and sequence parallelism, multi-host.

Everything goes through JAX's own partitioner: ``jax.jit`` with in/out shardings (what ``pjit``
became) for the step, ``jax.lax.with_sharding_constraint`` for activations (:func:`constrain`),
and ``jax.shard_map`` inside the attention kinds that run sharded over the sequence (ring
attention and the sequence-parallel linear scan live in their families, ``attention._ring`` and
``attention.linear._sequence_parallel``, so models can reach them; they are re-exported here).
The axis vocabulary is :mod:`xformers_jax.axes`. Without an active mesh every sharding call is
a no-op. Pipeline parallelism (GPipe over the ``stage`` axis: ``gpipe``, ``pipeline_layers``,
``microbatches_for``, ``bubble_fraction``) lives with the layer stacks in ``nn``, which
every LayerStack reaches on a mesh with a ``stage`` axis; it is re-exported here.
"""

from .. import axes as axes
from ..axes import active as active
from ._checkpoint import checkpoint_contents as checkpoint_contents
from ._checkpoint import checkpoint_tree as checkpoint_tree
from ._checkpoint import convert_index_checkpoint as convert_index_checkpoint
from ._checkpoint import fill_arrays as fill_arrays
from ._checkpoint import restore_checkpoint as restore_checkpoint
from ._checkpoint import restore_target as restore_target
from ._checkpoint import save_checkpoint as save_checkpoint
from ..attention import (
    sequence_parallel_linear_attention as sequence_parallel_linear_attention)
from ._mesh import make_mesh as make_mesh
from ..experts import expert_parallel_moe as expert_parallel_moe
from ..axes import STAGE as STAGE
from ..nn import bubble_fraction as bubble_fraction
from ..nn import microbatches_for as microbatches_for
from ..nn import gpipe as gpipe
from ..nn import pipeline_layers as pipeline_layers
from ._mesh import resolve_mesh_shape as resolve_mesh_shape
from ._mesh import use_mesh as use_mesh
from ._multihost import global_batch as global_batch
from ._multihost import initialize_from_env as initialize_from_env
from ._multihost import process_batch_slice as process_batch_slice
from ..attention import halo_local_attention as halo_local_attention
from ..attention import ring_attention as ring_attention
from ._rules import DEFAULT_COMPUTE_RULES as DEFAULT_COMPUTE_RULES
from ._rules import DEFAULT_PARAM_RULES as DEFAULT_PARAM_RULES
from ..axes import constrain as constrain
from ..axes import logical_sharding as logical_sharding
from ..axes import logical_to_spec as logical_to_spec
from ._rules import optimizer_shardings as optimizer_shardings
from ._rules import param_shardings as param_shardings
from ._rules import path_string as path_string
from ._strategies import STRATEGIES as STRATEGIES
from ._strategies import Strategy as Strategy
from ._strategies import strategy as strategy
