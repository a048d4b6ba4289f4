"""Device meshes from a dict of sizes, and the active mesh + rules context.

Without an active mesh every sharding call in this package is a no-op, so models annotated with
logical names run unchanged on one device.
"""

from __future__ import annotations

import contextlib
import math
from typing import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

from ..axes import MESH_AXES, Active, activated
from ._rules import DEFAULT_COMPUTE_RULES, DEFAULT_PARAM_RULES


def resolve_mesh_shape(sizes: Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """Sizes for every mesh axis of ``MESH_AXES`` (missing axes get 1, one ``-1`` fills).

    Raises ``ValueError`` for an unknown axis, more than one ``-1``, or sizes whose product is
    not ``num_devices``.
    """
    sizes = dict(sizes or {})
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh: unknown axes {unknown}; the mesh axes are {MESH_AXES}")
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise ValueError(f"mesh: at most one axis may be -1 (fill) but got {sizes}")
    bad = {a: s for a, s in sizes.items() if s != -1 and (not isinstance(s, int) or s < 1)}
    if bad:
        raise ValueError(f"mesh: sizes must be positive integers or -1 but got {bad}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if num_devices % known:
            raise ValueError(
                f"mesh: cannot fill {fill[0]!r}: {num_devices} devices are not divisible by the "
                f"product {known} of the other sizes {sizes}"
            )
        sizes[fill[0]] = num_devices // known
    shape = {a: sizes.get(a, 1) for a in MESH_AXES}
    if math.prod(shape.values()) != num_devices:
        raise ValueError(
            f"mesh: sizes {sizes} use {math.prod(shape.values())} devices but {num_devices} "
            "are available (use -1 on one axis to fill)"
        )
    return shape


def make_mesh(sizes: Mapping[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
    """A :class:`jax.sharding.Mesh` over all six mesh axes (``MESH_AXES`` order: ``stage``,
    the GPipe pipeline stages, then data, fsdp, expert, sequence, tensor).

    Args:
      sizes: e.g. ``{"data": -1, "tensor": 2}``; missing axes have size 1; ``-1`` fills.
      devices: the devices to use (default ``jax.devices()``: every device of every process).

    Returns:
      A mesh whose axes are ``MESH_AXES`` with the resolved sizes.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(sizes, len(devices))
    dims = tuple(shape[a] for a in MESH_AXES)
    # jax.make_mesh orders devices by the physical topology (ICI rings on TPU). Auto axes: the
    # partitioner propagates shardings from the annotations (the pjit model).
    return jax.make_mesh(
        dims, MESH_AXES, axis_types=(AxisType.Auto,) * len(dims), devices=devices
    )


@contextlib.contextmanager
def use_mesh(mesh: Mesh, compute_rules=None, param_rules=None):
    """Activates ``mesh`` and the logical->mesh rules (``xformers_jax.axes.activated``): the
    models' :func:`~xformers_jax.axes.constrain` calls and sequence-parallel attention read them.

    Rules default to ``DEFAULT_COMPUTE_RULES`` / ``DEFAULT_PARAM_RULES``. Sharding calls read
    the active mesh while a function is traced, so open the block around the ``jax.jit`` call
    that traces it.
    """
    rules = Active(
        mesh,
        tuple(DEFAULT_COMPUTE_RULES if compute_rules is None else compute_rules),
        tuple(DEFAULT_PARAM_RULES if param_rules is None else param_rules),
    )
    # jax.set_mesh too: JAX's trace caches key on its mesh context, so a function jitted
    # outside this block is traced again inside it (our context variable alone would let a
    # cached one-device trace run here without any sharding or sequence parallelism).
    with jax.set_mesh(mesh), activated(rules):
        yield mesh
