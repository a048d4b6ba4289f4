"""Pallas kernels for exact attention on GPU (Triton) and TPU (Mosaic).

Importing this package registers its kernels with the kernel layer's dispatch
(``xformers_jax.kernels``), which ``xformers_jax.attention`` consults for ``implementation=``.
A kernel is an object with ``name``, ``unsupported(call) -> list[str]`` (reasons it cannot run
a call; empty when it can) and ``__call__``. ``kernels_for(op)`` lists the kernels for an op
(``"flash_attention"``, ``"block_sparse_attention"``). This package imports only the kernel
layer.
"""

from __future__ import annotations

from xformers_jax.kernels import kernels_for as kernels_for
from xformers_jax.kernels import register as register


def _register_builtin() -> None:
    from . import _gpu_blocksparse, _gpu_mosaic, _tpu_blocksparse
    from ._common import PallasAttention

    # Tiles: each backend's default for the call's head dims (``default_blocks``).
    gpu = PallasAttention("pallas_gpu_blocksparse", "gpu", _gpu_blocksparse)
    tpu = PallasAttention("pallas_tpu_blocksparse", "tpu", _tpu_blocksparse)
    # Hopper GPUs first: from 4K on its forward took 0.63-0.87x the Triton forward's time and
    # its backward made fwd+bwd 1.13-1.54x faster than the Triton backward in the
    # gpu_attention suite (H200, 2026-11-28); it runs the Triton kernels itself for what it
    # does not cover (float32, flex mask functions, score functions that are not
    # elementwise, block layouts whose partial tiles are not a band).
    mosaic = PallasAttention("pallas_gpu_mosaic", "gpu", _gpu_mosaic)
    for op in ("flash_attention", "block_sparse_attention"):
        register(op, mosaic)
        register(op, gpu)
        register(op, tpu)


_register_builtin()
