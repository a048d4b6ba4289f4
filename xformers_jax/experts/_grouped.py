"""The grouped matmul of dropless dispatch, one switchable backend.

``grouped_matmul(x [m, k], w [G, k, n], group_sizes int[G]) -> [m, n]``: rows
``[s_g, s_g + group_sizes[g])`` of ``x`` (``s_g`` the cumulative sizes) are multiplied by
``w[g]``; rows past ``sum(group_sizes)`` give 0. Backends: ``"ragged_dot"`` (XLA's
``jax.lax.ragged_dot``, the default) and ``"dense"`` (a masked einsum computing every group on
every row: the reference, G times the work). A Pallas kernel registers itself with
:func:`register_grouped_matmul` and is picked by name.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def _ragged(x, w, group_sizes):
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32))


def _dense(x, w, group_sizes):
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    rows = jnp.arange(x.shape[0])
    member = (rows[None] >= starts[:, None]) & (rows[None] < ends[:, None])  # [G, m]
    out = jnp.einsum("mk,gkn->gmn", x, w)
    return jnp.einsum("gm,gmn->mn", member.astype(out.dtype), out)


_BACKENDS: dict[str, Callable] = {"ragged_dot": _ragged, "dense": _dense}
DEFAULT_BACKEND = "ragged_dot"


def register_grouped_matmul(name: str, fn: Callable, *, replace: bool = False) -> None:
    """Adds a backend ``fn(x, w, group_sizes) -> [m, n]``."""
    if name in _BACKENDS and not replace:
        raise ValueError(f"grouped matmul backend {name!r} exists; pass replace=True")
    _BACKENDS[name] = fn


def grouped_matmul_backends() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def grouped_matmul(x, w, group_sizes, *, backend: str | None = None):
    """See the module docstring. ``backend`` None uses :data:`DEFAULT_BACKEND`."""
    backend = backend or DEFAULT_BACKEND
    if backend not in _BACKENDS:
        raise ValueError(f"grouped_matmul: backend must be one of {tuple(_BACKENDS)}, got "
                         f"{backend!r}")
    if x.ndim != 2 or w.ndim != 3 or w.shape[1] != x.shape[1] or group_sizes.shape != (
            w.shape[0],):
        raise ValueError(f"grouped_matmul: need x [m, k], w [G, k, n], group_sizes [G]; got "
                         f"{x.shape}, {w.shape}, {group_sizes.shape}")
    return _BACKENDS[backend](x, w, group_sizes)
