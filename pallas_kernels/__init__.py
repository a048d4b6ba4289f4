"""Pallas kernels for exact attention on GPU (Triton) and TPU (Mosaic).

``xformers_jax.attention`` picks a kernel here through its ``implementation=`` dispatch. A
kernel is an object with ``name``, ``unsupported(call) -> list[str]`` (reasons it cannot run a
call; empty when it can) and ``__call__``. ``kernels_for(op)`` lists the kernels for an op
(``"flash_attention"``, ``"block_sparse_attention"``).
"""

from __future__ import annotations

_REGISTRY: dict[str, list] = {}


def register(op: str, kernel) -> None:
    """Adds ``kernel`` to the candidates for ``op`` (earlier registrations are preferred)."""
    _REGISTRY.setdefault(op, []).append(kernel)


def kernels_for(op: str) -> list:
    """The registered kernels for ``op``, in order of preference."""
    return list(_REGISTRY.get(op, ()))
