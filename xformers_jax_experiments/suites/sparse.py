"""Suite ``sparse``: block-sparse attention of fixed patterns vs full flash attention and the
dense-masked computation of the same pattern.

fp32, B=1, H=4, D=64, lifted with ``multihead``. "Local window 512" is ``Local(256, 256)``
(512 keys around each query, as Longformer/BigBird count a window); BigBird is block 64 with 3
window, 2 global and 3 random blocks. Both run with the default tiles, as a user calling
``block_sparse_attention(q, k, v, pattern)`` gets them: ``pattern_tile`` picks 256 for the
band and BigBird's own block of 64 (at 512 x 512 tiles BigBird is nearly dense). The
dense-masked contrast (the usual reference implementation: the full score matrix under the
pattern's mask) stops at L=8192, where its scores are already 256 MB per head.
"""

from __future__ import annotations

from xformers_jax.attention import (block_sparse_attention, dot_product_attention,
                                    flash_attention, multihead)
from xformers_jax.attention.patterns import BigBird, Local
from xformers_jax_experiments.bench_lib import (Case, Results, Workload, linear_growth_check,
                                                ratio_check)
from xformers_jax_experiments.suites.attention import attention_flops, qkv

TITLE = "Sparse patterns: block-sparse vs full flash vs dense-masked (fp32, B=1, H=4, D=64)"
_BUILD = "xformers_jax_experiments.suites.sparse:build"
LENGTHS = (8192, 16384)
DENSE_MAX = 8192


def pattern_of(name: str, quick: bool = False):
    if name == "local":
        return Local(8, 8) if quick else Local(256, 256)
    if name == "bigbird":
        return BigBird(8 if quick else 64, num_window_blocks=3, num_global_blocks=2,
                       num_random_blocks=3, seed=0)
    raise ValueError(f"unknown pattern {name!r}")


def build(variant: str, L: int, pattern: str = "none", quick: bool = False, B: int = 1, H: int = 4,
          D: int = 64):
    if variant == "flash":
        fn = lambda q, k, v: flash_attention(q, k, v)
        flops = attention_flops(L, B, H, D)
    else:
        p = pattern_of(pattern, quick)
        density = p.layout(L, L, 64, 64).dense().mean()
        flops = attention_flops(L, B, H, D) * density
        if variant == "sparse":
            tiles = dict(block_q=16, block_k=16) if quick else {}  # quick: several tiles
            fn = lambda q, k, v: block_sparse_attention(q, k, v, p, **tiles)
        elif variant == "dense":
            fn = lambda q, k, v: dot_product_attention(q, k, v, pattern=p)
        else:
            raise ValueError(f"unknown variant {variant!r}")
    lifted = multihead(fn)
    return Workload(lifted, qkv(L, B, H, D), flops=flops)


def cases(quick: bool) -> list[Case]:
    lengths = (64, 128) if quick else LENGTHS
    out = []
    for L in lengths:
        out.append(Case("flash (full)", _BUILD, dict(variant="flash", L=L)))
        for pattern in ("local", "bigbird"):
            out.append(Case(f"block-sparse {pattern}", _BUILD,
                            dict(variant="sparse", L=L, pattern=pattern, quick=quick)))
            if quick or L <= DENSE_MAX:
                out.append(Case(f"dense-masked {pattern}", _BUILD,
                                dict(variant="dense", L=L, pattern=pattern, quick=quick)))
    return out


def checks(r: Results):
    out = []
    for pattern in ("local", "bigbird"):
        name = f"block-sparse {pattern}"
        sparse = lambda L: r.time(name, "fwdbwd", L=L, pattern=pattern, variant="sparse",
                                  quick=False)
        out += [
            ratio_check(f"{pattern}: fwd+bwd speed-up over full flash at L=8192",
                        r.time("flash (full)", "fwdbwd", L=8192), sparse(8192), at_least=4.0),
            ratio_check(f"{pattern}: fwd+bwd time T(16384) / T(8192)", sparse(16384), sparse(8192),
                        at_most=2.3),
            linear_growth_check(f"{pattern}: fwd+bwd memory above start-up, 16K vs 8K (linear: "
                                "<= 2x, with 30% slack)", r, "delta_rss_mb", name, "fwdbwd",
                                LENGTHS, pattern=pattern, variant="sparse", quick=False),
        ]
    return out
