"""Suite ``attention``: the dense reference against flash attention.

fp32, B=1, H=4, D=64, lifted with ``multihead``. The dense reference stops at L=8192: at
16384 its scores alone would be 4 GB per head.
"""

from __future__ import annotations

import jax

from xformers_jax.attention import dot_product_attention, flash_attention, multihead
from xformers_jax_experiments.bench_lib import (Case, Results, Workload, linear_growth_check,
                                                ratio_check, value_check)

TITLE = "Exact attention: dense reference vs flash attention (fp32, B=1, H=4, D=64)"
_BUILD = "xformers_jax_experiments.suites.attention:build"
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
DENSE_MAX = 8192


def qkv(L: int, B: int = 1, H: int = 4, D: int = 64, dtype: str = "float32", Lk: int | None = None):
    """Random ``[B, L, H, D]`` inputs used by every attention suite."""
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    Lk = Lk or L
    return (jax.random.normal(kq, (B, L, H, D), dtype),
            jax.random.normal(kk, (B, Lk, H, D), dtype),
            jax.random.normal(kv, (B, Lk, H, D), dtype))


def attention_flops(L: int, B: int = 1, H: int = 4, D: int = 64, causal: bool = False) -> float:
    """Useful forward work of softmax attention (two matmuls; half of it when causal)."""
    return 4.0 * B * H * L * L * D * (0.5 if causal else 1.0)


def build(variant: str, L: int, causal: bool = False, B: int = 1, H: int = 4, D: int = 64):
    fn = {"dense": dot_product_attention, "flash": flash_attention}[variant]
    lifted = multihead(fn)
    return Workload(lambda q, k, v: lifted(q, k, v, causal=causal), qkv(L, B, H, D),
                    flops=attention_flops(L, B, H, D, causal))


def cases(quick: bool) -> list[Case]:
    lengths = (128, 256) if quick else LENGTHS
    out = []
    for L in lengths:
        if quick or L <= DENSE_MAX:
            out.append(Case("dense", _BUILD, dict(variant="dense", L=L)))
        out.append(Case("flash", _BUILD, dict(variant="flash", L=L)))
    for L in (lengths[-1],) if quick else (4096, 16384):
        out.append(Case("flash causal", _BUILD, dict(variant="flash", L=L, causal=True)))
    return out


def checks(r: Results):
    L = 4096
    return [
        value_check("flash fwd GFLOP/s at L=4096", r.value("gflops", "flash", "fwd", L=L),
                    at_least=100),
        value_check("flash fwd fraction of matmul rate at L=4096",
                    r.value("matmul_fraction", "flash", "fwd", L=L), at_least=0.6, fmt="{:.2f}"),
        ratio_check("fwd+bwd speed-up of flash over dense autodiff at L=4096",
                    r.time("dense", "fwdbwd", L=L), r.time("flash", "fwdbwd", L=L),
                    at_least=1.8),
        value_check("flash fwd+bwd peak RSS (MB) at L=16384",
                    r.value("peak_rss_mb", "flash", "fwdbwd", L=16384), at_most=1500,
                    fmt="{:.0f}"),
        linear_growth_check("flash fwd+bwd memory above start-up, 16K vs 4K (linear: <= 4x, "
                            "with 30% slack)", r, "delta_rss_mb", "flash", "fwdbwd",
                            (4096, 16384)),
        ratio_check("causal / non-causal flash fwd time at L=4096",
                    r.time("flash causal", "fwd", L=L, causal=True),
                    r.time("flash", "fwd", L=L), at_most=0.65),
    ]
