"""``implementation=None | "xla" | "pallas"``: choosing the kernel for an exact attention call.

Pallas kernels live in the top-level ``pallas_kernels`` package and describe themselves through
``pallas_kernels.kernels_for(op)``: each kernel has ``name`` and ``unsupported(call) -> list of
reasons``. ``None`` takes the first kernel with no reason against the call on this backend and
falls back to the XLA path; ``"pallas"`` raises with every reason when none fits.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax

IMPLEMENTATIONS = (None, "xla", "pallas")


def choose(op: str, implementation: str | None, call: Mapping[str, Any]):
    """Returns a Pallas kernel to run ``call`` with, or None for the XLA path."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{op}: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    if implementation == "xla":
        return None
    import pallas_kernels  # lower layer, imported lazily so the XLA path never needs it

    reasons = []
    backend = jax.default_backend()
    for kernel in pallas_kernels.kernels_for(op):
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
