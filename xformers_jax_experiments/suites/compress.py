"""Suite ``compress``: the int8 matmul path against float32 at the models' matmul shapes.

Forward only. ``fp32``: ``x @ w``. ``int8 dot``: the bare int8 x int8 -> int32 ``dot_general``
on pre-quantized operands. ``int8 layer``: what a quantized model runs per weight
(``x @ QuantizedWeight``): per-row activation quantization, the int8 dot and the rescale.
``int4 layer``: weight-only int4 (dequantize, then a float matmul). XLA:CPU lowers the int8
dot to a YNNPACK fusion (``__ynn_fusion`` in the compiled HLO). Which instructions YNNPACK
uses is not visible in the HLO, but the rates say it: on the 2-core Sapphire Rapids (2.6 GHz,
AMX-INT8) the int8 dot ran at 3.5 TOP/s at 2048 x 1024 x 1024, 11x float32 and above the
~1.3 TOP/s peak of AVX-512 VNNI on those cores, so it runs on AMX there; on the 2-core AMD
EPYC (VNNI, no AMX) it ran at 1.2x float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xformers_jax import compress as C
from xformers_jax_experiments.bench_lib import Case, Results, Workload, ratio_check

TITLE = "Quantized matmuls: int8 x int8 -> int32 and weight-only int4 against float32 (fwd)"
NOTE = ("Shapes: rows = batch x length, [rows, k] @ [k, n]; (4096, 64, 128) is the ListOps "
        "main job's FFN (batch 32 x 128 tokens, dim 64, MLP 128), (4096, 512, 1024) the LRA "
        "model's. Compare within the run.")
_BUILD = "xformers_jax_experiments.suites.compress:build"
SHAPES = ((4096, 64, 128), (4096, 512, 1024), (2048, 1024, 1024))


def build(variant: str, rows: int, k: int, n: int):
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (rows, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5
    flops = 2.0 * rows * k * n
    if variant == "fp32":
        return Workload(lambda x, w: x @ w, (x, w), flops=flops)
    if variant == "int8 dot":
        xq = C.quantize(x, C.absmax_scale(x))
        wq = C.quantize(w, C.absmax_scale(w))
        return Workload(C.int8_matmul, (xq, wq), flops=flops)
    if variant == "int8 layer":
        qw = C.QuantizedWeight.from_float(w)
        return Workload(lambda x, q, s: x @ C.QuantizedWeight(q, s), (x, qw.q, qw.scale),
                        flops=flops, grad_argnums=())
    if variant == "int4 layer":
        q4 = C.Int4Weight.from_float(w)
        return Workload(lambda x, p, s: x @ C.Int4Weight(p, s, q4.group), (x, q4.packed, q4.scale),
                        flops=flops, grad_argnums=())
    raise ValueError(f"unknown variant {variant!r}")


def cases(quick: bool) -> list[Case]:
    shapes = ((256, 64, 128),) if quick else SHAPES
    return [Case(v, _BUILD, dict(variant=v, rows=r, k=k, n=n), modes=("fwd",))
            for r, k, n in shapes for v in ("fp32", "int8 dot", "int8 layer", "int4 layer")]


def checks(r: Results):
    out = []
    for rows, k, n in SHAPES:
        p = dict(rows=rows, k=k, n=n)
        out.append(ratio_check(f"fp32 time / int8 dot time at {rows}x{k}x{n}",
                               r.time("fp32", "fwd", **p), r.time("int8 dot", "fwd", **p),
                               at_least=1.0))
        out.append(ratio_check(f"fp32 time / int8 layer time at {rows}x{k}x{n}",
                               r.time("fp32", "fwd", **p), r.time("int8 layer", "fwd", **p),
                               at_least=1.0))
    return out
