"""Suite ``gpu_linear``: causal linear attention on a GPU, chunked against the per-step scan.

The ``linear`` suite's cases (``xformers_jax_experiments/suites/linear.py``) at GPU sizes: FAVOR+
with 64 features, bf16 inputs (the recurrence's states are float32), B=4, H=8 (B·H = 32), D=64,
causal, lifted with ``multihead``. ``chunked`` is the chunked form (chunks of 64 by default,
128 and 256 at 8K), ``recurrent`` the per-step scan, ``flash causal`` exact causal attention
(the Pallas kernel on a GPU) at the same size. The target figures: the
chunked form at least 5x faster than the per-step scan at L = 8K (fwd+bwd), and linear in L
up to 64K (time and the step's device memory from L = 8K to 64K at most 8x, with 30% slack).
"""

from __future__ import annotations

from xformers_jax_experiments.bench_lib import Case, Results, linear_growth_check, ratio_check

TITLE = ("GPU causal linear attention: chunked vs per-step scan (FAVOR+ 64 features, bf16 "
         "inputs, B=4, H=8, D=64)")
NOTE = ("The 'flash causal' rows (context only; no figure uses them) were measured with the "
        "Pallas kernel as it was before its 128-row tiles for large head dims and its runs of "
        "consecutive blocks (64 x 64 tiles, every block index loaded); at D=64 the tiles are "
        "unchanged, and the gpu_attention suite measures the kernel as it is now.")
PLATFORMS = ("gpu",)
_BUILD = "xformers_jax_experiments.suites.linear:build"
SHORT = 8192
LENGTHS = (8192, 16384, 32768, 65536)
SIZE = dict(B=4, H=8, D=64, dtype="bfloat16")


def cases(quick: bool) -> list[Case]:
    if quick:
        p = dict(B=1, H=2, D=16, dtype="bfloat16")
        return [Case("chunked", _BUILD, dict(variant="chunked", L=256, **p)),
                Case("recurrent", _BUILD, dict(variant="recurrent", L=256, **p))]
    out = [Case("chunked", _BUILD, dict(variant="chunked", L=L, chunk_size=64, **SIZE))
           for L in LENGTHS]
    out += [Case("chunked", _BUILD, dict(variant="chunked", L=SHORT, chunk_size=c, **SIZE))
            for c in (128, 256)]
    out += [Case("recurrent", _BUILD, dict(variant="recurrent", L=SHORT, **SIZE)),
            Case("flash causal", _BUILD, dict(variant="flash causal", L=SHORT, **SIZE))]
    return out


def checks(r: Results):
    if r.find("chunked", "fwdbwd", L=SHORT) is None:
        return []
    chunked = r.time("chunked", "fwdbwd", L=SHORT, chunk_size=64)
    best = min((t for c in (64, 128, 256)
                if (t := r.time("chunked", "fwdbwd", L=SHORT, chunk_size=c)) is not None),
               default=None)
    rec = r.time("recurrent", "fwdbwd", L=SHORT)
    return [
        ratio_check(f"fwd+bwd speed-up of chunked (chunks of 64) over the per-step scan at "
                    f"L={SHORT}", rec, chunked, at_least=5),
        ratio_check(f"fwd+bwd speed-up of chunked (best chunk size) over the per-step scan at "
                    f"L={SHORT}", rec, best, at_least=5),
        linear_growth_check(f"chunked fwd+bwd time, L={LENGTHS[-1]} vs {SHORT} (linear, with "
                            "30% slack)", r, "time_s", "chunked", "fwdbwd",
                            (SHORT, LENGTHS[-1]), chunk_size=64),
        linear_growth_check(f"chunked fwd+bwd device memory (compiled step), L={LENGTHS[-1]} "
                            f"vs {SHORT} (linear, with 30% slack)", r, "compiled_mb", "chunked",
                            "fwdbwd", (SHORT, LENGTHS[-1]), chunk_size=64),
    ]
