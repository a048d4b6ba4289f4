"""Suite ``lowrank``: low-rank, compressed and prototype attention against flash attention.

fp32, B=1, H=4, D=64, lifted with ``multihead``: Linformer (k=256, E and F shared by the
heads), Nyströmformer (64 landmarks, with the conv skip), Luna (256 packed rows) and clustered
attention (100 clusters) against exact flash attention.
"""

from __future__ import annotations

import jax

from xformers_jax.attention import (
    clustered_attention,
    flash_attention,
    init_linformer_projections,
    init_luna_sequence,
    init_nystrom_conv,
    linformer_attention,
    luna_attention,
    multihead,
    nystrom_attention,
)
from xformers_jax_experiments.bench_lib import (Case, Results, Workload, linear_growth_check,
                                                ratio_check)
from xformers_jax_experiments.suites.attention import qkv

TITLE = "Low-rank / compressed / prototype attention vs flash attention (fp32, B=1, H=4, D=64)"
_BUILD = "xformers_jax_experiments.suites.lowrank:build"
LENGTHS = (1024, 4096, 16384)
VARIANTS = ("linformer", "nystrom", "luna", "clustered")
# The sizes the target figure is read at; --quick shrinks them with the lengths.
SIZES = {"linformer": 256, "nystrom": 64, "luna": 256, "clustered": 100}


def build(variant: str, L: int, size: int | None = None, B: int = 1, H: int = 4, D: int = 64):
    q, k, v = qkv(L, B, H, D)
    key = jax.random.PRNGKey(1)
    if variant == "flash":
        return Workload(multihead(flash_attention), (q, k, v))
    if variant == "linformer":
        e, f = init_linformer_projections(key, L, size)
        return Workload(multihead(linformer_attention, arg_axes=(None, None)), (q, k, v, e, f))
    if variant == "nystrom":
        lifted = multihead(lambda q, k, v, w: nystrom_attention(q, k, v, w, num_landmarks=size),
                           arg_axes=("heads",))
        conv = jax.vmap(init_nystrom_conv)(jax.random.split(key, H))
        return Workload(lifted, (q, k, v, conv))
    if variant == "luna":
        p = init_luna_sequence(key, size, D)
        return Workload(multihead(luna_attention, arg_axes=(None,)), (q, k, v, p))
    if variant == "clustered":
        lifted = multihead(lambda q, k, v, key: clustered_attention(q, k, v, num_clusters=size,
                                                                    key=key))
        return Workload(lambda q, k, v: lifted(q, k, v, key=key), (q, k, v))
    raise ValueError(f"lowrank suite: unknown variant {variant!r}")


def cases(quick: bool) -> list[Case]:
    lengths = (128, 256) if quick else LENGTHS
    out = [Case("flash", _BUILD, dict(variant="flash", L=L)) for L in lengths]
    for name in VARIANTS:
        size = min(SIZES[name], 16) if quick else SIZES[name]
        out += [Case(name, _BUILD, dict(variant=name, L=L, size=size)) for L in lengths]
    return out


def checks(r: Results):
    out = []
    for name in VARIANTS:
        out.append(ratio_check(
            f"{name} ({SIZES[name]}) fwd+bwd speed-up over flash at L=4096",
            r.time("flash", "fwdbwd", L=4096), r.time(name, "fwdbwd", L=4096), at_least=4.0))
    for name in VARIANTS:
        out.append(linear_growth_check(
            f"{name} fwd+bwd time, 16K vs 4K (linear: <= 4x, with 30% slack)", r, "time_s",
            name, "fwdbwd", (4096, 16384)))
        out.append(linear_growth_check(
            f"{name} fwd+bwd memory above start-up, 16K vs 4K (linear: <= 4x, with 30% slack)",
            r, "delta_rss_mb", name, "fwdbwd", (4096, 16384)))
    return out
