"""Suite ``gpu_decode``: the decoding atlas (``xformers_jax_experiments/suites/decode.py``) on a
GPU, to 256K tokens of context.

The same model and cases as ``decode`` (a 2-layer ``CausalLM`` at dim 256, float32, the kind in
every layer; ``steps`` decoding steps of the whole batch in one ``lax.scan`` from a cache
holding ``L`` tokens, donated and rewound after each call), at contexts 4K-256K and batches 1
and 16 (exact attention's cache at 256K is 1 GiB per sequence: 16 GiB at batch 16). ``read``
sums a 2 GiB float32 array: the device's memory bandwidth in this run. The serving rows stay
in ``decode`` (their figure is the scheduler's, not the device's).

The target figures: a recurrent or windowed kind's step at 256K within 1.2x of its step at 4K
(its state does not grow), and exact attention's step at 64K and 256K (batch 1) within 2x of
reading its cache once at the measured bandwidth. Times are wall time: on a GPU the host's
CPU time says nothing about the step.
"""

from __future__ import annotations

from xformers_jax_experiments.bench_lib import Case, ratio_check
from xformers_jax_experiments.suites import decode

TITLE = ("GPU decoding: time per step and cache bytes per sequence against context to 256K, "
         "per kind")
NOTE = ("`time (ms)` is for `steps` decoding steps of the whole batch (B sequences advance "
        "`steps` tokens); `state_kib` is one sequence's cache or state.")
PLATFORMS = ("gpu",)
_BUILD = "xformers_jax_experiments.suites.decode:"
CONTEXTS, QUICK_CONTEXTS = (4096, 16384, 65536, 262144), (128,)
BATCHES, QUICK_BATCHES = (1, 16), (1,)
READ_MIB, QUICK_READ_MIB = 2048, 16


def cases(quick: bool) -> list[Case]:
    contexts = QUICK_CONTEXTS if quick else CONTEXTS
    out = [Case("read", _BUILD + "build_read", dict(mib=QUICK_READ_MIB if quick else READ_MIB),
                ("fwd",))]
    for kind in ("dot_product",) if quick else decode.KINDS:  # quick: the harness's check
        for b in QUICK_BATCHES if quick else BATCHES:
            for n in contexts:
                out.append(Case(kind, _BUILD + "build", dict(kind=kind, L=n, B=b), ("fwd",)))
    return out


def checks(r):
    read_case = r.find("read", "fwd")
    if read_case is None or read_case["params"].get("mib") != READ_MIB:
        return []  # a quick run
    short, long = CONTEXTS[0], CONTEXTS[-1]
    out = []
    for kind in decode.RECURRENT_OR_WINDOW:
        for b in BATCHES:
            out.append(ratio_check(f"{kind}: time per step at L={long} / at L={short} (B={b})",
                                   r.time(kind, "fwd", L=long, B=b),
                                   r.time(kind, "fwd", L=short, B=b), at_most=1.2))
    read = r.time("read", "fwd")
    for n in (65536, 262144):
        exact = r.time("dot_product", "fwd", L=n, B=1)
        if read and exact:
            seconds_to_read = decode.state_kib("dot_product", n) / 1024 / READ_MIB * read
            out.append(ratio_check(
                f"dot_product at L={n}, B=1: time per token / reading its cache once at the "
                f"measured bandwidth ({READ_MIB / read / 1024:.0f} GiB/s)",
                exact / decode.steps_of("dot_product"), seconds_to_read, at_most=2.0))
        else:
            out.append(ratio_check(f"dot_product at L={n}, B=1: time per token / reading its "
                                   "cache once", None, None, at_most=2.0))
    return out
