"""One axis vocabulary for parameters and activations, at the bottom of the package.

Logical axis names say what a dimension means (``embed``, ``heads``, ``length``); mesh axis
names say where devices are (``data``, ``fsdp``, ``sequence``, ``tensor``). Ordered rules map
the first onto the second (MaxText's ``logical_axis_rules``; Levanter/Haliax's axis mappings),
so one model runs unchanged under any parallelism. Everything that names an axis uses this
module:

- **parameters** declare their logical axes where they are defined, as field metadata::

      class FeedForward(eqx.Module):
          w1: jax.Array = axes.param(EMBED, MLP)

  :func:`declared_axes` reads them back for any tree, whatever the attribute is called;
  leading axes a layer stack adds (``eqx.filter_vmap`` over layers) are named ``layers``.
- **activations** are annotated with :func:`constrain` (a no-op outside a mesh).
- **the active mesh** (set by ``xformers_jax.parallel.use_mesh``) is read with :func:`active`;
  attention kinds that run sharded over ``length`` (ring attention, the sequence-parallel
  scan) ask :func:`sequence_shards`.

It imports nothing else from the package, so every layer (the attention functions, the
models, the trainer) can use it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import NamedTuple, Sequence

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Logical axes.
BATCH = "batch"
LENGTH = "length"
EMBED = "embed"
HEADS = "heads"
KV = "kv"  # the per-head feature dimension
MLP = "mlp"
VOCAB = "vocab"
EXPERTS = "experts"
LAYERS = "layers"  # the leading axis of a layer stack's parameters (never split)
LOGICAL_AXES = (BATCH, LENGTH, EMBED, HEADS, KV, MLP, VOCAB, EXPERTS, LAYERS)

# Mesh axes, in the order devices are laid out: the last axis is the one whose devices are
# closest (same host / ICI neighbours), so it carries the most traffic (tensor, sequence).
# ``stage`` (GPipe pipeline stages, parallel.pipeline_layers) is first: its neighbours exchange
# only one activation per micro-batch, the least traffic of all.
STAGE = "stage"
DATA = "data"
FSDP = "fsdp"
EXPERT = "expert"
SEQUENCE = "sequence"
TENSOR = "tensor"
MESH_AXES = (STAGE, DATA, FSDP, EXPERT, SEQUENCE, TENSOR)

# Activation layouts the models use.
TOKENS = (BATCH, LENGTH, EMBED)
HEADS_LAYOUT = (BATCH, LENGTH, HEADS, KV)
HIDDEN = (BATCH, LENGTH, MLP)
LOGITS = (BATCH, LENGTH, VOCAB)

_META = "logical_axes"


# -- parameters ---------------------------------------------------------------------------------

def param(*names: str | None, **field_kwargs):
    """An Equinox field whose array has one logical axis name per dimension.

    ``w: jax.Array = param(EMBED, HEADS)``. Other keyword arguments go to ``eqx.field``. A
    field holding None (an optional weight) is fine. Unknown names raise at class definition.
    """
    unknown = [n for n in names if n is not None and n not in LOGICAL_AXES]
    if unknown:
        raise ValueError(f"axes.param: unknown logical axes {unknown}; known: {LOGICAL_AXES}")
    metadata = dict(field_kwargs.pop("metadata", {}) or {})
    metadata[_META] = tuple(names)
    return eqx.field(metadata=metadata, **field_kwargs)


class Names(tuple):
    """A tuple of logical names that pytree functions treat as one leaf."""


jax.tree_util.register_pytree_node(Names, lambda n: ((), tuple(n)), lambda aux, _: Names(aux))


def _field_axes(node, name: str):
    if not dataclasses.is_dataclass(node):
        return None
    for f in dataclasses.fields(node):
        if f.name == name:
            return f.metadata.get(_META)
    return None


def _child(node, key):
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return jax.tree_util.tree_leaves(node)[key.key]
    raise TypeError(f"declared_axes: cannot follow key {key!r}")


def declared_axes(tree):
    """The logical axis names of every array leaf of ``tree``, from the fields declaring them.

    Args:
      tree: a pytree (an Equinox model, an optax state's parameter-shaped part, ...).

    Returns:
      A pytree like ``eqx.filter(tree, eqx.is_array)`` whose array leaves are :class:`Names`
      (one entry per dimension; all None for an array no field declares, which is then
      replicated) and whose other leaves are None. An array with more dimensions than its
      declaration (a layer stack's leading axes) gets ``layers`` for the extra leading ones.

    Raises:
      ValueError: an array with fewer dimensions than its field declares (naming the path).
    """
    def one(path, leaf):
        if not eqx.is_array(leaf):
            return None
        node, names = tree, None
        for i, key in enumerate(path):
            if i == len(path) - 1 and isinstance(key, jax.tree_util.GetAttrKey):
                names = _field_axes(node, key.name)
            node = _child(node, key)
        if names is None:
            return Names((None,) * leaf.ndim)
        extra = leaf.ndim - len(names)
        if extra < 0:
            raise ValueError(
                f"declared_axes: {jax.tree_util.keystr(path)} has shape {leaf.shape} but its "
                f"field declares {len(names)} axes {names}")
        return Names((LAYERS,) * extra + tuple(names))

    return jax.tree_util.tree_map_with_path(one, tree)


# -- rules ----------------------------------------------------------------------------------------

def _as_tuple(axes) -> tuple:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(
    names: Sequence[str | None], rules, mesh: Mesh, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """The ``PartitionSpec`` for an array whose dimensions have logical ``names``.

    For each dimension the first rule ``(logical, mesh_axes)`` for its name whose mesh axes are
    not already used by another dimension (and divide the dimension, when ``shape`` is given)
    wins; mesh axes of size 1 are dropped, so one rule table serves every strategy and the mesh
    sizes decide what is split.

    Args:
      names: one logical name (or None: replicated) per dimension.
      rules: ordered ``(logical, mesh_axes)`` pairs; ``mesh_axes`` a mesh axis, a tuple of
        them, or None.
      mesh: the mesh.
      shape: the array's shape, when known.

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


# -- the active mesh --------------------------------------------------------------------------------

class Active(NamedTuple):
    """The mesh and the rules sharding calls use while ``parallel.use_mesh`` is open."""

    mesh: Mesh
    compute_rules: tuple
    param_rules: tuple


_ACTIVE: contextvars.ContextVar[Active | None] = contextvars.ContextVar(
    "xformers_jax_mesh", default=None)


def active() -> Active | None:
    """The active mesh and rules, or None outside ``parallel.use_mesh``."""
    return _ACTIVE.get()


@contextlib.contextmanager
def activated(value: Active):
    """Makes ``value`` the active mesh and rules inside the block (``parallel.use_mesh``)."""
    token = _ACTIVE.set(value)
    try:
        yield value
    finally:
        _ACTIVE.reset(token)


def mesh_for(axis: str, mesh: Mesh | None = None) -> tuple[Mesh | None, int]:
    """``(mesh, size of axis)``: the given mesh or else the active one (``(None, 1)`` without
    either). The sequence-parallel attention functions resolve their mesh with this."""
    if mesh is None and active() is not None:
        mesh = active().mesh
    return mesh, 1 if mesh is None else dict(mesh.shape).get(axis, 1)


def mesh_axis_size(axis: str) -> int:
    """The size of mesh axis ``axis`` in the active mesh (1 without one)."""
    return mesh_for(axis)[1]


def sequence_shards() -> int:
    """How many pieces the ``sequence`` mesh axis splits ``length`` into (1 without a mesh):
    the attention kinds that run sharded over the sequence check this."""
    return mesh_axis_size(SEQUENCE)


def constrain(x, names: Sequence[str | None]):
    """Annotates activation ``x`` with logical axis ``names`` (one per dimension).

    Inside ``parallel.use_mesh`` this is ``jax.lax.with_sharding_constraint`` under the active
    compute rules; without an active mesh it returns ``x`` unchanged. E.g.
    ``constrain(h, axes.TOKENS)``.
    """
    ctx = active()
    if ctx is None:
        return x
    return jax.lax.with_sharding_constraint(
        x, logical_sharding(names, ctx.compute_rules, ctx.mesh, x.shape))
