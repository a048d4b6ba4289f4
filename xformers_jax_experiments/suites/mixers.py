"""Suite ``mixers``: token mixers against flash attention of the same width (fp32, B=1,
dim 256 = 4 heads x 64), fwd+bwd.

- FNet's mixing (``Re(FFT2)``, over the sequence and the 256 channels) against non-causal
  flash attention at L=8192: the target is at least 20x.
- The recurrences' cores against causal flash at L=8192 (at least 5x): S4D (256 channels,
  N=64, FFT convolution of the Vandermonde kernel), RetNet chunkwise retention (4 heads of
  64), GLA (4 heads, keys 32, per-feature gates), Mamba-2's chunked SSD (8 heads of 64, N=64,
  as ``expand=2``), Gated DeltaNet (4 heads of 64, chunked triangular solves); Mamba's
  selective scan (512 channels, N=16) is timed for the scaling figure.
- Every recurrence from L=8192 to 65536: at most 9x (linear is 8x).
- The short causal convolution of Mamba, H3, Hyena and the recurrences (``short_conv``; 4
  taps over the 768 channels of q, k and v at dim 256), fwd+bwd with its own reverse-mode
  rule against the backward XLA derives from the same shifted sum (the form it had before),
  its output multiplied by its input so that the backward gets a cotangent that is not all
  ones: a (why) figure, what the rule saves.

Inputs are random; decays/gates are drawn as the modules' initialisations would give them.
The cores exclude the projections (as flash excludes its q/k/v/o projections).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xformers_jax import mixers as M
from xformers_jax.attention import flash_attention, multihead
from xformers_jax_experiments.bench_lib import Case, Workload, ratio_check
from xformers_jax_experiments.suites.attention import attention_flops, qkv

TITLE = "Token mixers vs flash attention of the same width (fp32, B=1, dim 256)"
NOTE = ("Recurrences are timed as their cores on precomputed per-head inputs (no "
        "projections), flash as the attention kernel on precomputed q, k, v. The machine is "
        "shared with other jobs while this runs: ratios within the run are what count.")
_BUILD = "xformers_jax_experiments.suites.mixers:build"
SHORT, LONG = 8192, 65536
QUICK_SHORT, QUICK_LONG = 256, 2048
DIM, HEADS, HEAD_DIM = 256, 4, 64
RECURRENCES = ("s4d", "retnet", "gla", "mamba2", "gated_deltanet", "mamba")
CHUNK = 64  # GLA runs at its own default (16: its intra-chunk decays are [c, c, key])


def _normal(i, *shape):
    return jax.random.normal(jax.random.PRNGKey(i), shape)


def _heads(fn, *arrays):
    """``fn`` over a leading head axis."""
    return jax.vmap(fn)(*arrays)


def build(variant: str, L: int):
    if variant in ("flash", "flash causal"):
        q, k, v = qkv(L, 1, HEADS, HEAD_DIM)
        causal = variant == "flash causal"
        return Workload(lambda q, k, v: multihead(flash_attention)(q, k, v, causal=causal),
                        (q, k, v), flops=attention_flops(L, 1, HEADS, HEAD_DIM, causal))
    if variant == "fnet":
        x = _normal(0, L, DIM)
        return Workload(lambda x: M.fourier_mixing(x), (x,))
    if variant == "s4d":
        n = 32  # N = 64 states as 32 conjugate pairs
        u = _normal(0, L, DIM)
        log_dt = jnp.linspace(jnp.log(1e-3), jnp.log(1e-1), DIM)
        a_im = jnp.pi * jnp.broadcast_to(jnp.arange(n, dtype=jnp.float32), (DIM, n))
        c = _normal(1, 2, DIM, n) * 0.7
        d = _normal(2, DIM)

        def fn(u, log_dt, c):
            a = -0.5 + 1j * a_im
            return M.s4d(u, jnp.exp(log_dt), a, jnp.ones((DIM, n), jnp.complex64),
                         c[0] + 1j * c[1], d)

        return Workload(fn, (u, log_dt, c))
    if variant in ("retnet", "gla", "gated_deltanet"):
        dk = HEAD_DIM // 2 if variant == "gla" else HEAD_DIM
        q, k = _normal(0, HEADS, L, dk) * dk ** -0.5, _normal(1, HEADS, L, dk) * dk ** -0.5
        v = _normal(2, HEADS, L, HEAD_DIM)
        if variant == "retnet":
            lg = jnp.log1p(-2.0 ** (-5.0 - jnp.arange(HEADS)))
            return Workload(lambda q, k, v: _heads(
                lambda q, k, v, g: M.retention(q, k, v, g, chunk_size=CHUNK), q, k, v, lg),
                (q, k, v))
        if variant == "gla":
            g = jax.nn.log_sigmoid(_normal(3, HEADS, L, dk)) / 16
            return Workload(lambda q, k, v, g: _heads(
                lambda *a: M.gla(*a), q, k, v, g), (q, k, v, g))
        unit = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        beta = jax.nn.sigmoid(_normal(4, HEADS, L))
        ld = -jax.nn.softplus(_normal(5, HEADS, L)) * 0.1
        return Workload(lambda q, k, v, beta, ld: _heads(
            lambda *a: M.gated_delta(*a, chunk_size=CHUNK), q, k, v, beta, ld),
            (q, unit, v, beta, ld))
    if variant == "mamba2":
        h, p, n = 8, 64, 64
        x = _normal(0, h, L, p)
        dt = jax.nn.softplus(_normal(1, h, L) - 4)
        a = -jnp.linspace(1.0, 16.0, h)
        b, c = _normal(2, L, n) * n ** -0.5, _normal(3, L, n) * n ** -0.5
        return Workload(lambda x, dt, b, c: jax.vmap(
            lambda x, dt, a: M.ssd(x, dt, a, b, c, chunk_size=CHUNK))(x, dt, a),
            (x, dt, b, c))
    if variant == "mamba":
        d, n = 2 * DIM, 16
        x = _normal(0, L, d)
        delta = jax.nn.softplus(_normal(1, L, d) - 4)
        a = -jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.float32), (d, n))
        b, c = _normal(2, L, n), _normal(3, L, n)
        return Workload(lambda x, delta, b, c: M.selective_scan(x, delta, a, b, c),
                        (x, delta, b, c))
    if variant in ("short conv", "short conv, derived backward"):
        x, w = _normal(0, 1, L, 3 * DIM), _normal(1, 4, 3 * DIM)
        conv = M.causal_depthwise_conv if variant == "short conv" else _shifted_sum
        # Times x: the convolution's output cotangent is then an array, as in a model (the
        # harness differentiates the sum of the output, and a cotangent of ones lets XLA fold
        # the derived backward into a few sums).
        return Workload(lambda x, w: conv(x, w, None) * x, (x, w))
    raise ValueError(f"unknown variant {variant!r}")


def _shifted_sum(x, w, b):
    """``causal_depthwise_conv``'s forward as a plain sum of shifted copies, differentiated by
    JAX: the backward the library's own rule replaces."""
    width, length = w.shape[0], x.shape[1]
    xp = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
    return sum(xp[:, i: i + length] * w[i] for i in range(width))


def cases(quick: bool) -> list[Case]:
    short, long = (QUICK_SHORT, QUICK_LONG) if quick else (SHORT, LONG)
    out = [Case(v, _BUILD, dict(variant=v, L=short), ("fwdbwd",))
           for v in ("flash", "flash causal", "fnet", "short conv",
                     "short conv, derived backward")]
    for v in RECURRENCES:
        out += [Case(v, _BUILD, dict(variant=v, L=n), ("fwdbwd",)) for n in (short, long)]
    return out


def checks(r):
    quick = r.find("fnet", "fwdbwd", L=SHORT) is None
    short, long = (QUICK_SHORT, QUICK_LONG) if quick else (SHORT, LONG)
    t = lambda name, n=short: r.time(name, "fwdbwd", L=n)  # noqa: E731
    out = [ratio_check(f"fwd+bwd speed-up of FNet mixing over flash attention at L={short}",
                       t("flash"), t("fnet"), at_least=20)]
    for v in ("s4d", "retnet", "gla", "mamba2"):
        out.append(ratio_check(f"fwd+bwd speed-up of {v} over causal flash at L={short}",
                               t("flash causal"), t(v), at_least=5))
    out.append(ratio_check(f"(extra) fwd+bwd speed-up of gated_deltanet over causal flash at "
                           f"L={short}", t("flash causal"), t("gated_deltanet"), at_least=5))
    for v in RECURRENCES:
        out.append(ratio_check(f"{v} fwd+bwd time, L={long} / L={short}", t(v, long), t(v),
                               at_most=9))
    out.append(ratio_check(
        f"(why) the short convolution's own backward: fwd+bwd speed-up over XLA's derived one, "
        f"[1, {short}, {3 * DIM}], 4 taps", t("short conv, derived backward"), t("short conv"),
        at_least=1))
    return out
