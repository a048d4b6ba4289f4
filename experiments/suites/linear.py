"""Suite ``linear``: causal linear attention, chunked vs per-step scan vs causal flash (issue 4).

fp32, B=1, H=4, D=64, FAVOR+ with 64 orthogonal random features (the projection shared by the
heads), lifted with ``multihead``. The chunked form should beat the per-step scan by 5x and
causal flash attention by more than 3x at L=8192, and grow linearly to L=65536.
"""

from __future__ import annotations

import jax

from experiments.bench_lib import Case, Results, Workload, linear_growth_check, ratio_check
from experiments.suites.attention import qkv
from xformers_jax.attention import (
    flash_attention,
    init_random_projection,
    linear_attention,
    multihead,
)

TITLE = "Causal linear attention: chunked vs per-step scan vs causal flash (fp32, B=1, H=4, D=64)"
_BUILD = "experiments.suites.linear:build"
SHORT, LONG = 8192, 65536
QUICK_SHORT, QUICK_LONG = 256, 2048
NUM_FEATURES = 64


def build(variant: str, L: int, B: int = 1, H: int = 4, D: int = 64, chunk_size: int = 64):
    q, k, v = qkv(L, B, H, D)
    if variant == "flash causal":
        return Workload(lambda q, k, v: multihead(flash_attention)(q, k, v, causal=True),
                        (q, k, v))
    projection = init_random_projection(jax.random.PRNGKey(1), NUM_FEATURES, D)
    impl = {"chunked": "chunked", "recurrent": "recurrent"}[variant]
    lifted = multihead(linear_attention)

    def fn(q, k, v):
        return lifted(q, k, v, projection, feature_map="favor_positive", causal=True,
                      implementation=impl, chunk_size=chunk_size)

    return Workload(fn, (q, k, v))


def cases(quick: bool) -> list[Case]:
    short, long = (QUICK_SHORT, QUICK_LONG) if quick else (SHORT, LONG)
    return [
        Case("chunked", _BUILD, dict(variant="chunked", L=short)),
        Case("chunked", _BUILD, dict(variant="chunked", L=long)),
        Case("recurrent", _BUILD, dict(variant="recurrent", L=short)),
        Case("flash causal", _BUILD, dict(variant="flash causal", L=short)),
    ]


def checks(r: Results):
    quick = r.find("chunked", "fwdbwd", L=SHORT) is None
    short, long = (QUICK_SHORT, QUICK_LONG) if quick else (SHORT, LONG)
    chunked = r.time("chunked", "fwdbwd", L=short)
    return [
        ratio_check(f"fwd+bwd speed-up of chunked over the per-step scan at L={short}",
                    r.time("recurrent", "fwdbwd", L=short), chunked, at_least=5),
        ratio_check(f"fwd+bwd time of chunked / causal flash at L={short}",
                    chunked, r.time("flash causal", "fwdbwd", L=short), at_most=0.3),
        ratio_check(f"chunked fwd+bwd time, L={long} / L={short}",
                    r.time("chunked", "fwdbwd", L=long), chunked, at_most=9),
        linear_growth_check(f"chunked fwd+bwd memory above start-up, L={long} vs {short} "
                            "(linear, with 30% slack)", r, "delta_rss_mb", "chunked", "fwdbwd",
                            (short, long)),
    ]
