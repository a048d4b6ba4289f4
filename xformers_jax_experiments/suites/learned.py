"""Suite ``learned``: content-based sparse attention (LSH, Sinkhorn, routing) against flash.

fp32, B=1, H=4, D=64, lifted with ``multihead``. LSH: chunk 128, 2 rounds
(buckets L / 128); Sinkhorn: block 128; routing: window 256 with L / 256 clusters. The dense
replacements of softmax (entmax, top-k) and adaptive span are measured at one length for
reference; they carry no figure.

Sinkhorn runs its hard sort (``hard=True``: each sorted block is one gathered block) with the
straight-through gradient on the 8 largest entries of each row of the soft sort matrix
(``straight_through_top=8``), the mode whose cost is linear in L. The soft sort (the library's
default, the paper's) mixes every block into every sorted block, ``L^2 D / block`` work, and
cannot be linear: at L=32768 it is as much work as the block attention itself.
"""

from __future__ import annotations

import math

import jax

from xformers_jax.attention import (
    adaptive_span_attention, entmax_attention, flash_attention, init_lsh_rotations,
    init_routing_state, init_sinkhorn_sort_net, lsh_attention, multihead, routing_attention,
    sinkhorn_attention, topk_attention,
)
from xformers_jax_experiments.bench_lib import (Case, Results, Workload, linear_growth_check,
                                                ratio_check)
from xformers_jax_experiments.suites.attention import attention_flops, qkv

TITLE = "Learned and content-based sparsity vs flash attention (fp32, B=1, H=4, D=64)"
_BUILD = "xformers_jax_experiments.suites.learned:build"
LENGTHS = (2048, 8192, 32768)
FLASH_LENGTHS = (2048, 8192)


def build(variant: str, L: int, B: int = 1, H: int = 4, D: int = 64, size: int = 128):
    q, k, v = qkv(L, B, H, D)
    key = jax.random.PRNGKey(1)
    if variant == "flash":
        f = multihead(flash_attention)
        return Workload(lambda q, k, v: f(q, k, v), (q, k, v), flops=attention_flops(L, B, H, D))
    if variant == "lsh":
        rot = init_lsh_rotations(key, D, max(2, 2 * (L // size // 2)), num_rounds=2)
        f = multihead(lsh_attention)
        # Shared QK: the keys are the queries.
        return Workload(lambda q, v: f(q, q, v, rot, chunk_size=size), (q, v))
    if variant in ("sinkhorn", "sinkhorn_soft"):
        net = init_sinkhorn_sort_net(key, D, -(-L // size))
        f = multihead(sinkhorn_attention)
        mode = dict(hard=True, straight_through_top=8) if variant == "sinkhorn" else {}
        return Workload(lambda q, k, v: f(q, k, v, net, block_size=size, **mode), (q, k, v))
    if variant == "routing":
        state = init_routing_state(key, max(1, L // size), D)
        f = multihead(routing_attention)
        return Workload(lambda q, k, v: f(q, k, v, state, window=size)[0], (q, k, v))
    if variant == "entmax15":
        f = multihead(entmax_attention)
        return Workload(lambda q, k, v: f(q, k, v, 1.5), (q, k, v))
    if variant == "topk":
        f = multihead(topk_attention)
        return Workload(lambda q, k, v: f(q, k, v, top_k=size), (q, k, v))
    if variant == "adaptive_span":
        f = multihead(adaptive_span_attention)
        span = jax.numpy.full((), size / 2)
        return Workload(lambda q, k, v, s: f(q, k, v, s, max_span=size, causal=True),
                        (q, k, v, span))
    raise ValueError(f"unknown variant {variant!r}")


_SIZES = {"lsh": 128, "sinkhorn": 128, "routing": 256}


def cases(quick: bool) -> list[Case]:
    if quick:
        out = [Case("flash", _BUILD, dict(variant="flash", L=256))]
        for v, size in _SIZES.items():
            out.append(Case(v, _BUILD, dict(variant=v, L=256, size=min(size, 128))))
        out += [Case(v, _BUILD, dict(variant=v, L=256, size=32))
                for v in ("entmax15", "topk", "adaptive_span")]
        return out
    out = [Case("flash", _BUILD, dict(variant="flash", L=L)) for L in FLASH_LENGTHS]
    for v, size in _SIZES.items():
        out += [Case(v, _BUILD, dict(variant=v, L=L, size=size)) for L in LENGTHS]
    # The soft sort (the library's default), for reference: quadratic (L^2 D / block).
    out += [Case("sinkhorn_soft", _BUILD, dict(variant="sinkhorn_soft", L=L, size=128))
            for L in LENGTHS[1:]]
    out += [Case(v, _BUILD, dict(variant=v, L=2048, size=256))
            for v in ("entmax15", "topk", "adaptive_span")]
    return out


def checks(r: Results):
    L = 8192
    flash = r.time("flash", "fwdbwd", L=L)
    out = [
        ratio_check("fwd+bwd speed-up of LSH (chunk 128, 2 rounds) over flash at L=8192",
                    flash, r.time("lsh", "fwdbwd", L=L), at_least=3.0),
        ratio_check("fwd+bwd speed-up of Sinkhorn (block 128, hard sort, straight-through top 8)"
                    " over flash at L=8192",
                    flash, r.time("sinkhorn", "fwdbwd", L=L), at_least=4.0),
        ratio_check("fwd+bwd speed-up of routing (window 256) over flash at L=8192",
                    flash, r.time("routing", "fwdbwd", L=L), at_least=4.0),
    ]
    lo, hi = LENGTHS[1], LENGTHS[-1]
    log_factor = math.log(hi) / math.log(lo)
    out.append(linear_growth_check(
        f"LSH fwd+bwd time, {hi // 1024}K vs {lo // 1024}K (L log L: <= 4x * log ratio, 30% slack)",
        r, "time_s", "lsh", "fwdbwd", (lo, hi), slack=1.3 * log_factor))
    for v in ("sinkhorn", "routing"):
        out.append(linear_growth_check(
            f"{v} fwd+bwd time, {hi // 1024}K vs {lo // 1024}K (linear: <= 4x, 30% slack)",
            r, "time_s", v, "fwdbwd", (lo, hi)))
    return out
