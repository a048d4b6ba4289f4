"""The mesh and rules in force while a ``parallel.use_mesh`` block is open.

Its own module so that the rules (``_rules``) can read the active mesh and ``use_mesh``
(``_mesh``) can install the rules without the two importing each other.
"""

from __future__ import annotations

import contextvars
from typing import NamedTuple

from jax.sharding import Mesh


class Active(NamedTuple):
    """The mesh and the rules sharding calls use while a :func:`use_mesh` block is open."""

    mesh: Mesh
    compute_rules: tuple
    param_rules: tuple


_ACTIVE: contextvars.ContextVar[Active | None] = contextvars.ContextVar("xformers_jax_mesh", default=None)


def active() -> Active | None:
    """The active mesh and rules, or None outside :func:`use_mesh`."""
    return _ACTIVE.get()
