"""Parallelism strategies as config settings: a name and sizes -> mesh shape and rules.

One rule table serves every strategy (``_rules``: axes of size 1 drop out), so a strategy is
which mesh axes get devices:

- ``data``: the batch is split; parameters and optimizer state are replicated.
- ``fsdp``: the batch is split too, and parameters and optimizer state are split along
  ``embed`` (ZeRO-3 / FSDP); XLA all-gathers each layer's weights where they are used and
  reduce-scatters their gradients.
- ``tensor``: Megatron tensor parallelism (Shoeybi et al. 2019): attention heads and the MLP
  hidden dimension are split, so each layer needs one all-reduce after attention and one after
  the MLP.
- ``sequence``: activations are split along ``length``; attention runs as ring attention
  (exact) or by prefix-state passing (causal linear attention).
- ``expert``: mixture-of-experts weights are split over experts.

Combinations join names with ``+`` (``"data+tensor"``, ``"fsdp+sequence"``).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import jax

from .. import axes as A
from ._mesh import make_mesh, resolve_mesh_shape
from ._rules import DEFAULT_COMPUTE_RULES, DEFAULT_PARAM_RULES

STRATEGIES = {
    "single": (),
    "data": (A.DATA,),
    "fsdp": (A.FSDP,),
    "tensor": (A.TENSOR,),
    "sequence": (A.SEQUENCE,),
    "expert": (A.EXPERT,),
}


class Strategy(NamedTuple):
    """A parallelism setting: mesh sizes per axis, parameter rules, compute rules."""

    mesh_shape: dict
    param_rules: tuple
    compute_rules: tuple

    def mesh(self, devices=None):
        """The mesh of this strategy over ``devices`` (default all)."""
        return make_mesh(self.mesh_shape, devices)


def strategy(name: str, sizes: Mapping[str, int] | None = None, num_devices: int | None = None):
    """The :class:`Strategy` called ``name`` (``"data"``, ``"fsdp+tensor"``, ...).

    Args:
      name: strategy names from ``STRATEGIES`` joined with ``+``.
      sizes: mesh axis sizes for the named strategies' axes; an axis not given is ``-1``
        (fill) when it is the only one missing, else an error. E.g.
        ``strategy("data+tensor", {"tensor": 2})`` on 8 devices is ``data=4, tensor=2``.
      num_devices: default ``jax.device_count()``.

    Returns:
      ``Strategy(mesh_shape, DEFAULT_PARAM_RULES, DEFAULT_COMPUTE_RULES)``.
    """
    parts = [p for p in name.split("+") if p]
    unknown = [p for p in parts if p not in STRATEGIES]
    if unknown or not parts:
        raise ValueError(f"strategy: unknown {unknown or name!r}; known: {sorted(STRATEGIES)}")
    axes = [a for p in parts for a in STRATEGIES[p]]
    sizes = dict(sizes or {})
    extra = sorted(set(sizes) - set(axes))
    if extra:
        raise ValueError(f"strategy {name!r}: sizes for axes it does not use: {extra}")
    missing = [a for a in axes if a not in sizes]
    if len(missing) > 1:
        raise ValueError(
            f"strategy {name!r}: give sizes for all but one of {missing} (that one fills)"
        )
    sizes.update({a: -1 for a in missing})
    n = jax.device_count() if num_devices is None else num_devices
    if not axes:
        n = 1  # "single": one device
    shape = resolve_mesh_shape(sizes, n)
    return Strategy(shape, DEFAULT_PARAM_RULES, DEFAULT_COMPUTE_RULES)
