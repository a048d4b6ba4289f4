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
- **roles**: what a parameter is decides whether weight decay applies (:func:`decayed`): a
  declared parameter with two or more axes is a weight, one with fewer (a bias, a gain, a
  norm's scale) is not, and ``param(..., decay=False)`` says so of a table that is not a
  weight (learned position tables); an undeclared array counts its dimensions without the
  layer axes of the :func:`stacked` fields above it. **Fixed buffers** (Performer's random
  features, LSH rotations, ALiBi's slopes: arrays nothing learns) are wrapped in
  :class:`Buffer`; the trainer's optimizer leaves them out (:func:`fixed_buffers`) and
  checkpoints keep them.
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
_DECAY = "weight_decay"
_STACKED = "stacked_layers"


# -- parameters ---------------------------------------------------------------------------------

def param(*names: str | None, decay: bool | None = None, **field_kwargs):
    """An Equinox field whose array has one logical axis name per dimension.

    ``w: jax.Array = param(EMBED, HEADS)``. Other keyword arguments go to ``eqx.field``. A
    field holding None (an optional weight) is fine. Unknown names raise at class definition.
    ``decay``: whether weight decay applies (:func:`decayed`); None: when two or more axes
    are declared (a weight matrix, not a bias or a gain).
    """
    unknown = [n for n in names if n is not None and n not in LOGICAL_AXES]
    if unknown:
        raise ValueError(f"axes.param: unknown logical axes {unknown}; known: {LOGICAL_AXES}")
    metadata = dict(field_kwargs.pop("metadata", {}) or {})
    metadata[_META] = tuple(names)
    if decay is not None:
        metadata[_DECAY] = bool(decay)
    return eqx.field(metadata=metadata, **field_kwargs)


def stacked(**field_kwargs):
    """An Equinox field holding modules built under ``eqx.filter_vmap`` over layers (a layer
    stack's blocks): every array below it has one leading ``layers`` axis, which
    :func:`decayed` does not count as one of the parameter's own."""
    metadata = dict(field_kwargs.pop("metadata", {}) or {})
    metadata[_STACKED] = True
    return eqx.field(metadata=metadata, **field_kwargs)


class Buffer(eqx.Module):
    """A fixed, non-learned array inside a model (Performer's random projection, Reformer's
    LSH rotations, a fixed random synthesizer's logits, ALiBi's slopes, Cluster-Former's
    k-means centroids): saved and restored with the model, never differentiated, never
    touched by the optimizer (no optimizer state, no weight decay, not in the gradient norm).

    ``value`` is the array; code that uses it reads ``buffer.value`` (or :func:`unbuffer` on a
    pytree), under ``stop_gradient``.
    """

    value: jax.Array


def unbuffer(tree):
    """``tree`` with every :class:`Buffer` replaced by its value under ``stop_gradient``."""
    return jax.tree.map(lambda b: jax.lax.stop_gradient(b.value) if isinstance(b, Buffer) else b,
                        tree, is_leaf=lambda x: isinstance(x, Buffer))


class Names(tuple):
    """A tuple of logical names that pytree functions treat as one leaf."""


jax.tree_util.register_pytree_node(Names, lambda n: ((), tuple(n)), lambda aux, _: Names(aux))


def _field(node, name: str):
    if not dataclasses.is_dataclass(node):
        return None
    for f in dataclasses.fields(node):
        if f.name == name:
            return f
    return None


def _field_axes(node, name: str):
    field = _field(node, name)
    return None if field is None else field.metadata.get(_META)


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


class _Found(NamedTuple):
    names: tuple | None  # the declaring field's names (None: undeclared)
    decay: bool | None  # the declaring field's decay (None: by the number of axes)
    layers: int  # stacked layer axes above the leaf
    buffer: bool  # inside a Buffer
    ndim: int


def _walk(tree):
    """Per array leaf of ``tree``, what the fields on its path declare (a :class:`_Found`);
    None for other leaves."""
    def one(path, leaf):
        if not eqx.is_array(leaf):
            return None
        node, meta, layers, buffer = tree, {}, 0, False
        for i, key in enumerate(path):
            buffer = buffer or isinstance(node, Buffer)
            field = _field(node, key.name) if isinstance(key, jax.tree_util.GetAttrKey) else None
            if field is not None and field.metadata.get(_STACKED):
                layers += 1
            if i == len(path) - 1:
                meta = {} if field is None else field.metadata
            node = _child(node, key)
        return _Found(meta.get(_META), meta.get(_DECAY), layers, buffer, leaf.ndim)

    return jax.tree_util.tree_map_with_path(one, tree)


def decayed(tree):
    """Whether weight decay applies to each array leaf of ``tree`` (a bool pytree; None at
    other leaves): a weight is a declared parameter with two or more axes (or ``decay=True``)
    or an undeclared array with two or more dimensions besides its stacked ``layers`` axes;
    biases, gains and norm scales (one axis), ``decay=False`` fields (position tables) and
    :class:`Buffer` values never decay."""
    def rule(found):
        if found is None:
            return None
        if found.buffer:
            return False
        if found.decay is not None:
            return found.decay
        own = len(found.names) if found.names is not None else found.ndim - found.layers
        return own >= 2

    return jax.tree.map(rule, _walk(tree), is_leaf=lambda x: isinstance(x, _Found))


def fixed_buffers(tree):
    """True for each array leaf of ``tree`` inside a :class:`Buffer` (None at non-array
    leaves): what an optimizer must leave out."""
    return jax.tree.map(lambda f: None if f is None else f.buffer, _walk(tree),
                        is_leaf=lambda x: isinstance(x, _Found))


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
