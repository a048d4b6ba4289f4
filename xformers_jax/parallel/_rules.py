"""Ordered logical->mesh rules, their resolution to ``PartitionSpec``, and parameter annotation.

A rule is ``(logical_name, mesh_axes)`` with ``mesh_axes`` a mesh axis name, a tuple of them, or
None. For each dimension the first rule for its logical name whose mesh axes are not already
used by another dimension (and divide the dimension, when the shape is known) wins; mesh axes of
size 1 are dropped, so one rule table serves every strategy and the mesh sizes decide what is
split (MaxText's ``logical_axis_rules``). Parameters and activations have separate tables:
FSDP splits parameters along ``embed`` but activations along ``batch``.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import jax
import equinox as eqx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _axes as A
from ._active import active

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
# layer's weights where the activations need them.
DEFAULT_PARAM_RULES = (
    (A.HEADS, A.TENSOR),
    (A.MLP, A.TENSOR),
    (A.VOCAB, A.TENSOR),
    (A.EXPERTS, A.EXPERT),
    (A.EMBED, A.FSDP),
    (A.KV, None),
    (A.BATCH, None),
    (A.LENGTH, None),
)


def _as_tuple(axes) -> tuple:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(
    names: Sequence[str | None], rules, mesh: Mesh, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """The ``PartitionSpec`` for an array whose dimensions have logical ``names``.

    Args:
      names: one logical name (or None: replicated) per dimension.
      rules: ordered ``(logical, mesh_axes)`` pairs.
      mesh: the mesh (axes of size 1 are ignored).
      shape: the array's shape; when given, a rule whose mesh size does not divide the
        dimension is skipped (the next rule, or replication, applies).

    Returns:
      A ``PartitionSpec`` with one entry per dimension.
    """
    names = tuple(names)
    if shape is not None and len(shape) != len(names):
        raise ValueError(f"logical_to_spec: names {names} do not match the shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for d, name in enumerate(names):
        chosen = None
        for logical, axes in rules:
            if logical != name:
                continue
            axes = tuple(a for a in _as_tuple(axes) if mesh.shape.get(a, 1) > 1)
            if used.intersection(axes):
                continue
            size = math.prod(mesh.shape[a] for a in axes)
            if shape is not None and shape[d] % size:
                continue
            chosen = axes
            break
        used.update(chosen or ())
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    return PartitionSpec(*spec)


def logical_sharding(names, rules, mesh: Mesh, shape=None) -> NamedSharding:
    """``NamedSharding(mesh, logical_to_spec(names, rules, mesh, shape))``."""
    return NamedSharding(mesh, logical_to_spec(names, rules, mesh, shape))


def constrain(x, names: Sequence[str | None]):
    """Annotates activation ``x`` with logical axis ``names`` (one per dimension).

    Inside :func:`use_mesh` this is ``jax.lax.with_sharding_constraint`` under the active
    compute rules; without an active mesh it returns ``x`` unchanged. Models call it on their
    activations, e.g. ``constrain(h, ("batch", "length", "embed"))``.
    """
    ctx = active()
    if ctx is None:
        return x
    return jax.lax.with_sharding_constraint(
        x, logical_sharding(names, ctx.compute_rules, ctx.mesh, x.shape)
    )


def path_string(path) -> str:
    """A pytree key path as ``"layers/0/attention/wq"`` (what annotation regexes match)."""
    parts = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def param_logical_names(tree, patterns):
    """Logical names for every array leaf of ``tree`` (e.g. an Equinox model) by regex.

    Args:
      tree: a pytree; non-array leaves are left as they are (None in the result).
      patterns: ordered ``(regex, names)``; the first regex that ``re.search``-es a leaf's
        :func:`path_string` gives its names (a tuple with one entry per dimension). Leaves no
        pattern matches are replicated (all-None names).

    Returns:
      A pytree like ``eqx.filter(tree, eqx.is_array)`` whose array leaves are replaced by name
      tuples (wrapped so they stay leaves).
    """
    compiled = [(re.compile(p), tuple(n)) for p, n in patterns]

    def one(path, leaf):
        if not eqx.is_array(leaf):
            return None
        where = path_string(path)
        for regex, names in compiled:
            if regex.search(where):
                if len(names) != leaf.ndim:
                    raise ValueError(
                        f"param_logical_names: {where!r} has shape {leaf.shape} but pattern "
                        f"{regex.pattern!r} gives {len(names)} names {names}"
                    )
                return _Names(names)
        return _Names((None,) * leaf.ndim)

    return jax.tree_util.tree_map_with_path(one, tree)


class _Names(tuple):
    """A tuple of logical names that pytree functions treat as one leaf."""


jax.tree_util.register_pytree_node(_Names, lambda n: ((), tuple(n)), lambda aux, _: _Names(aux))


def param_shardings(tree, patterns, rules, mesh: Mesh):
    """``NamedSharding`` for every array leaf of ``tree`` (None elsewhere).

    The result has the structure of ``eqx.filter(tree, eqx.is_array)``, so it can be given to
    ``jax.device_put`` or to ``jax.jit(in_shardings=..., out_shardings=...)`` for the arrays.
    """
    arrays = eqx.filter(tree, eqx.is_array)
    names = param_logical_names(arrays, patterns)
    return jax.tree_util.tree_map(
        lambda x, n: logical_sharding(tuple(n), rules, mesh, x.shape),
        arrays,
        names,
        is_leaf=lambda n: isinstance(n, _Names),
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
