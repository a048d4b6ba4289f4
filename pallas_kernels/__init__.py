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


def _register_builtin() -> None:
    # Imported here, not at the top, so ``register``/``kernels_for`` exist before the kernel
    # modules (which import this package's helpers) load.
    from . import _gpu_blocksparse, _tpu_blocksparse
    from ._common import PallasAttention

    gpu = PallasAttention("pallas_gpu_blocksparse", "gpu", _gpu_blocksparse,
                          _gpu_blocksparse.DEFAULT_BLOCK_Q, _gpu_blocksparse.DEFAULT_BLOCK_K)
    tpu = PallasAttention("pallas_tpu_blocksparse", "tpu", _tpu_blocksparse,
                          _tpu_blocksparse.DEFAULT_BLOCK_Q, _tpu_blocksparse.DEFAULT_BLOCK_K)
    for op in ("flash_attention", "block_sparse_attention"):
        register(op, gpu)
        register(op, tpu)


_register_builtin()
