"""The default logical->mesh rule tables and the shardings of parameters and optimizer state.

A rule is ``(logical_name, mesh_axes)`` (see :func:`xformers_jax.axes.logical_to_spec`: the first
rule whose mesh axes are free and divide the dimension wins; axes of size 1 drop out, so one
table serves every strategy and the mesh sizes decide what is split: MaxText's
``logical_axis_rules``). Parameters and activations have separate tables: FSDP splits
parameters along ``embed`` but activations along ``batch``. Parameters' logical names come from
the fields that declare them (:func:`xformers_jax.axes.param`), never from their paths.
"""

from __future__ import annotations

import jax
import equinox as eqx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import axes as A
from ..axes import constrain as constrain  # noqa: F401  (re-exported by the package)
from ..axes import declared_axes, logical_sharding

# Activations: the batch is split over every data-like axis (FSDP is data parallel for
# compute), the sequence over `sequence`, heads and the MLP hidden over `tensor` (Megatron).
DEFAULT_COMPUTE_RULES = (
    (A.BATCH, (A.DATA, A.FSDP)),
    (A.LENGTH, A.SEQUENCE),
    (A.HEADS, A.TENSOR),
    (A.MLP, A.TENSOR),
    (A.VOCAB, A.TENSOR),
    (A.EXPERTS, A.EXPERT),
    (A.EMBED, None),
    (A.KV, None),
)

# Parameters: Megatron tensor parallelism splits heads / MLP hidden / vocab over `tensor`; FSDP
# splits every weight along `embed` (present in all of them) over `fsdp`, and XLA gathers each
# layer's weights where the activations need them. A layer stack's leading axis is never split.
DEFAULT_PARAM_RULES = (
    (A.HEADS, A.TENSOR),
    (A.MLP, A.TENSOR),
    (A.VOCAB, A.TENSOR),
    (A.EXPERTS, A.EXPERT),
    (A.EMBED, A.FSDP),
    (A.KV, None),
    (A.BATCH, None),
    (A.LENGTH, None),
    (A.LAYERS, None),
)


def path_string(path) -> str:
    """A pytree key path as ``"layers/0/attention/wq"`` (for messages and checkpoint keys)."""
    parts = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def param_shardings(tree, rules, mesh: Mesh):
    """``NamedSharding`` for every array leaf of ``tree`` (None elsewhere), from the logical
    axes its fields declare (:func:`xformers_jax.axes.declared_axes`); undeclared arrays are
    replicated.

    The result has the structure of ``eqx.filter(tree, eqx.is_array)``, so it can be given to
    ``jax.device_put`` or to ``jax.jit(in_shardings=..., out_shardings=...)`` for the arrays.
    """
    arrays = eqx.filter(tree, eqx.is_array)
    return jax.tree_util.tree_map(
        lambda x, n: logical_sharding(tuple(n), rules, mesh, x.shape),
        arrays,
        declared_axes(arrays),
        is_leaf=lambda n: isinstance(n, A.Names),
    )


def optimizer_shardings(optimizer, opt_state, param_shardings_tree, mesh: Mesh):
    """Shardings for an optax state: parameter-shaped leaves (Adam's moments, ...) follow their
    parameter's sharding, so FSDP shards optimizer state too; other leaves are replicated."""
    import optax

    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        opt_state,
        param_shardings_tree,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
