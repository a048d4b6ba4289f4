"""Suite ``models``: activation memory of deep encoders.

A pre-LN encoder layer stack (d=256, 4 heads, FFN 1024, flash attention, fp32, B=2, L=2048),
trained for one step's gradient with respect to every parameter. Peak memory is the fresh
worker process's resident-set growth (``delta_rss_mb``). Stacks: ``plain`` (scan, no remat),
``remat_full`` (gradient checkpointing: each layer keeps only its input) and ``reversible``
(RevNet blocks whose backward pass rebuilds activations), at 2 and 12 layers.
"""

from __future__ import annotations

import equinox as eqx
import jax

from xformers_jax import nn
from xformers_jax_experiments.bench_lib import Case, Results, Workload, ratio_check

TITLE = "Deep encoder memory: plain vs remat(full) vs reversible stacks (fp32, d=256, L=2048)"
_BUILD = "xformers_jax_experiments.suites.models:build"
STACKS = {"plain": {}, "remat_full": {"remat": "full"}, "reversible": {"reversible": True}}


def build(stack: str, layers: int, L: int, d: int = 256, B: int = 2, heads: int = 4):
    key = jax.random.PRNGKey(0)
    spec = nn.AttentionSpec("flash")
    model = nn.LayerStack(
        lambda k: nn.TransformerBlock(d, heads, 4 * d, spec=spec, max_len=L, key=k), layers,
        key=key, **STACKS[stack])
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x = jax.random.normal(jax.random.PRNGKey(1), (B, L, d))

    def forward(params, x):
        return eqx.combine(params, static)(x)

    flops = layers * (2 * B * L * 12 * d * d + 4 * B * L * L * d)
    return Workload(forward, (params, x), flops=flops, grad_argnums=(0,))


def cases(quick: bool) -> list[Case]:
    L, d = (128, 32) if quick else (2048, 256)
    return [Case(name, _BUILD, dict(stack=name, layers=n, L=L, d=d), ("fwdbwd",))
            for name in STACKS for n in (2, 12)]


def checks(r: Results):
    def mem(stack, layers):
        return r.value("delta_rss_mb", stack, "fwdbwd", layers=layers, L=2048)

    out = []
    for stack in ("reversible", "remat_full"):
        out.append(ratio_check(
            f"{stack}: 12-layer peak memory / plain 2-layer model's (L=2048)",
            mem(stack, 12), mem("plain", 2), at_most=1.3))
    out.append(ratio_check("plain stack: 12-layer / 2-layer peak memory (grows with depth)",
                           mem("plain", 12), mem("plain", 2), at_least=2.0))
    return out
