"""The activation-sharding hook the models call, below both ``nn`` and ``parallel``.

``xformers_jax.nn`` annotates activations with logical axis names but must not import
``xformers_jax.parallel`` (a higher layer: DESIGN.md). So the hook lives here: ``nn`` calls
:func:`constrain`, and ``parallel.use_mesh`` installs the real implementation (which resolves
the names under the active mesh's rules) for the duration of its block. Without an installed
implementation every call returns its input unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Sequence

_CONSTRAIN: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "xformers_jax_constrain", default=None
)


def constrain(x, names: Sequence[str | None]):
    """``x`` annotated with one logical axis name per dimension (a no-op without a mesh)."""
    fn = _CONSTRAIN.get()
    return x if fn is None else fn(x, names)


@contextlib.contextmanager
def installed(fn: Callable):
    """Makes :func:`constrain` call ``fn(x, names)`` inside the block."""
    token = _CONSTRAIN.set(fn)
    try:
        yield
    finally:
        _CONSTRAIN.reset(token)
