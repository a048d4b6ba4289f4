"""Suite ``memory``: segment-level recurrence costs the same at every segment.

A Transformer-XL byte LM (2 layers, d=128, 4 heads, FFN 512, dot-product attention with
Transformer-XL relative positions, fp32, B=2 streams, segment 128, memory 128; sized for a
loaded 2-core CPU) and the same model with a Compressive Transformer memory (memory 128,
compressed memory 64, rate 4, conv):
the gradient of one segment's loss given the memory left by the segments before it, after 1 and
after 50 segments (``segments`` = how many the memory has seen, including this one). The memory
is a fixed-size carried state under ``stop_gradient``, so the step time and the step's memory
(XLA's compiled buffers and the worker's resident-set growth) must not depend on how much text
came before. Both cases run the same warm-up program, so they differ only in the memory's
contents.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from xformers_jax import models, nn
from xformers_jax_experiments.bench_lib import Case, Results, Workload, ratio_check

TITLE = "Recurrent memory: train step at segment 1 vs segment 50 (XL, compressive; fp32)"
_BUILD = "xformers_jax_experiments.suites.memory:build"


def _memory(kind, d, seg, mem):
    if kind == "xl":
        return nn.XLMemory(mem)
    return functools.partial(nn.CompressiveMemory, d, mem, mem // 2, 4, compression="conv")


def build(kind: str, segments: int, seg: int = 128, mem: int = 128, d: int = 128,
          layers: int = 2, B: int = 2, heads: int = 4):
    longest = seg + mem + mem // 2
    position = nn.TransformerXLRelative(heads, d // heads, longest, key=jax.random.PRNGKey(2))
    model = models.CausalLM(257, d, layers, heads, 4 * d, positions=nn.NoPositions(),
                        max_len=longest, block=dict(position=position,
                                                    memory=_memory(kind, d, seg, mem)),
                        key=jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (segments, B, seg + 1), 1, 257)
    forward = jax.jit(lambda m, t, s: m(t, memory=s)[1])
    fresh = memory = model.init_memory(B)
    # The memory the earlier segments leave. At segment 1 the forward still runs once (and its
    # memory is dropped), so both cases compile and run the same programs and the resident
    # memory compared is the step's, not the warm-up's.
    for s in range(max(segments - 1, 1)):
        memory = forward(model, tokens[s, :, :-1], memory)
    if segments == 1:
        memory = fresh
    x, y = tokens[-1, :, :-1], tokens[-1, :, 1:]

    def loss(params, memory, x, y):
        logits, new = eqx.combine(params, static)(x, memory=memory)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1).mean()
        return ce + nn.memory_aux_loss(new), new

    def step(params, memory, x, y):
        grads, new = jax.grad(loss, has_aux=True)(params, memory, x, y)
        return grads, new

    flops = layers * (2 * B * seg * 12 * d * d + 4 * B * seg * (seg + mem) * d) * 3.5
    return Workload(step, (params, memory, x, y), flops=flops)


def cases(quick: bool) -> list[Case]:
    size = dict(seg=32, mem=32, d=32, layers=2, B=2) if quick else {}
    return [Case(kind, _BUILD, dict(kind=kind, segments=n, **size), ("step",))
            for kind in ("xl", "compressive") for n in (1, 50)]


def checks(r: Results):
    out = []
    for kind in ("xl", "compressive"):
        for field, label in (("time_s", "step time"), ("compiled_mb", "compiled memory"),
                             ("delta_rss_mb", "peak resident memory")):
            get = (lambda n, f=field: r.value(f, kind, "step", segments=n))
            out.append(ratio_check(f"{kind}: {label} at segment 50 / segment 1",
                                   get(50), get(1), at_most=1.2))
    return out
