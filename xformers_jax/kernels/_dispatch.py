"""``implementation=None | "xla" | "pallas" | <kernel name>``: choosing the kernel for an exact
attention call.

Kernels register here (``register(op, kernel)``); the top-level ``pallas_kernels`` package
registers its Pallas kernels when it is imported (``xformers_jax.attention`` imports it on the
first call that may use one). Each kernel has ``name`` and ``unsupported(call) -> list of
reasons``. ``None`` takes the first kernel with no reason against the call on this backend and
falls back to the XLA path; ``"pallas"`` raises with every reason when none fits; a registered
kernel's name (``"pallas_gpu_mosaic"``, say) takes that kernel or raises with its reasons.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax

IMPLEMENTATIONS = (None, "xla", "pallas")

_REGISTRY: dict[str, list] = {}


def register(op: str, kernel) -> None:
    """Adds ``kernel`` to the candidates for ``op`` (earlier registrations are preferred)."""
    if any(k.name == kernel.name for k in _REGISTRY.get(op, ())):
        raise ValueError(f"a kernel named {kernel.name!r} is already registered for {op!r}")
    _REGISTRY.setdefault(op, []).append(kernel)


def kernels_for(op: str) -> list:
    """The registered kernels for ``op``, in order of preference."""
    return list(_REGISTRY.get(op, ()))


def choose(op: str, implementation: str | None, call: Mapping[str, Any]):
    """Returns a Pallas kernel to run ``call`` with, or None for the XLA path."""
    named = {k.name: k for k in kernels_for(op)}
    if implementation not in IMPLEMENTATIONS and implementation not in named:
        raise ValueError(
            f"{op}: implementation must be one of {IMPLEMENTATIONS} or a registered kernel's "
            f"name {tuple(named)}, got {implementation!r}"
        )
    if implementation == "xla":
        return None
    reasons = []
    backend = jax.default_backend()
    if implementation in named:
        kernel = named[implementation]
        why = list(kernel.unsupported(dict(call, backend=backend)))
        if why:
            raise NotImplementedError(
                f"{op}: implementation={implementation!r} cannot run this call on backend "
                f"{backend!r}: " + "; ".join(why))
        return kernel
    for kernel in kernels_for(op):
        why = list(kernel.unsupported(dict(call, backend=backend)))
        if not why:
            return kernel
        reasons += [f"{kernel.name}: {r}" for r in why]
    if implementation == "pallas":
        if not reasons:
            reasons = [f"no Pallas kernel for {op} is available in this build"]
        raise NotImplementedError(
            f"{op}: implementation='pallas' cannot run this call on backend {backend!r}: "
            + "; ".join(reasons)
            + ". Use implementation=None to fall back to the XLA path."
        )
    return None
