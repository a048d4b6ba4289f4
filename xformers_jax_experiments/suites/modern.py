"""Suite ``modern``: the recurrences since the surveys against causal flash attention of the
same width (fp32, B=1, 4 heads of 64), fwd+bwd.

- mLSTM (xLSTM's stabilised matrix memory, chunks of 64), HGRN2 (per-channel forget gates,
  chunks of 16), Kimi Delta Attention and RWKV-7 (the per-channel generalised delta rule,
  chunks of 8), Gated DeltaProduct (``n_h = 2`` delta steps per token, chunks of 16
  sub-steps): at L=8192, each at least 3x faster than causal flash attention.
- Log-linear Mamba-2 (Guo et al. 2025; N = P = 64, chunks of 128, one B and C shared by the
  heads as in Mamba-2): at L=8192 at least 3x faster than causal flash attention too; from
  L=8192 to L=65536 at most 9 x 10/7 = 12.9x (L log L: its chunk-level states grow from 7 to
  10 at 64 positions per chunk, from 6 to 9 at 128; the bound keeps the stricter ratio).
- Each other from L=8192 to L=65536: at most 9x (linear is 8x).

Inputs are random; gates and decays are drawn as the modules' initialisations would give
them. The cores exclude the projections (as flash excludes its q/k/v/o projections).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xformers_jax import mixers as M
from xformers_jax.attention import flash_attention, multihead, num_levels
from xformers_jax_experiments.bench_lib import Case, Workload, ratio_check
from xformers_jax_experiments.suites.attention import attention_flops, qkv

TITLE = "Recurrences since the surveys vs causal flash attention (fp32, B=1, 4 heads of 64)"
NOTE = ("Recurrences are timed as their cores on precomputed per-head inputs (no "
        "projections), flash as the attention kernel on precomputed q, k, v. The machine is "
        "shared with other jobs while this runs: ratios within the run are what count.")
_BUILD = "xformers_jax_experiments.suites.modern:build"
SHORT, LONG = 8192, 65536
QUICK_SHORT, QUICK_LONG = 256, 2048
HEADS, HEAD_DIM = 4, 64
RECURRENCES = ("mlstm", "hgrn2", "kda", "rwkv7", "delta_product", "loglinear_mamba2")
# L log L: 64K/8K grows the chunk-level Fenwick states from log2(8192/64) = 7 to 10 (from 6 to
# 9 at the chunks of 128 the mixer now uses; the bound keeps the stricter 10/7).
LONG_BOUND = {"loglinear_mamba2": 9 * 10 / 7}
NH = 2  # DeltaProduct's Householder steps per token


def _normal(i, *shape):
    return jax.random.normal(jax.random.PRNGKey(i), shape)


def _unit(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _heads(fn, *arrays):
    """``fn`` over a leading head axis."""
    return jax.vmap(fn)(*arrays)


def build(variant: str, L: int):
    h, d = HEADS, HEAD_DIM
    if variant == "flash causal":
        q, k, v = qkv(L, 1, h, d)
        return Workload(lambda q, k, v: multihead(flash_attention)(q, k, v, causal=True),
                        (q, k, v), flops=attention_flops(L, 1, h, d, True))
    q, k, v = _normal(0, h, L, d) * d ** -0.5, _normal(1, h, L, d) * d ** -0.5, _normal(2, h, L, d)
    if variant == "mlstm":
        i, f = _normal(3, h, L), _normal(4, h, L) + 4.5
        return Workload(lambda *a: _heads(M.mlstm, *a), (q, k, v, i, f))
    if variant == "hgrn2":
        log_f = jax.nn.log_sigmoid(_normal(3, h, L, d) + 2.0)
        return Workload(lambda *a: _heads(M.hgrn2, *a), (q, v, log_f))
    if variant == "kda":
        beta = jax.nn.sigmoid(_normal(3, h, L))
        log_alpha = -jax.nn.softplus(_normal(4, h, L, d) - 4.0)
        return Workload(lambda *a: _heads(M.kda, *a), (_unit(q), _unit(k), v, beta, log_alpha))
    if variant == "rwkv7":
        log_w = -jnp.exp(-0.5) * jax.nn.sigmoid(_normal(3, h, L, d))
        kappa, a, u = _unit(_normal(4, h, L, d)), jax.nn.sigmoid(_normal(5, h, L, d)), _normal(
            6, h, d) * 0.1
        return Workload(lambda *x: _heads(M.rwkv7, *x), (q, k, v, log_w, kappa, a, u))
    if variant == "delta_product":
        ks, vs = _unit(_normal(3, h, L, NH, d)), _normal(4, h, L, NH, d)
        beta = 2 * jax.nn.sigmoid(_normal(5, h, L, NH))
        ld = -jax.nn.softplus(_normal(6, h, L)) * 0.1
        return Workload(lambda *a: _heads(M.delta_product, *a), (_unit(q), ks, vs, beta, ld))
    if variant == "loglinear_mamba2":
        dt = jax.nn.softplus(_normal(3, h, L) - 4.0)
        a = -jnp.exp(_normal(4, h) * 0.5)
        b, c = _normal(5, L, d) * d ** -0.5, _normal(6, L, d) * d ** -0.5
        lam = jax.nn.softplus(_normal(7, h, L, num_levels(L)))

        def run(x, dt, a, lam, b, c):
            return jax.vmap(M.loglinear_ssd, in_axes=(0, 0, 0, None, None, 0))(x, dt, a, b, c,
                                                                              lam)

        return Workload(run, (v, dt, a, lam, b, c))
    raise ValueError(f"unknown variant {variant!r}")


def cases(quick: bool) -> list[Case]:
    short, long = (QUICK_SHORT, QUICK_LONG) if quick else (SHORT, LONG)
    out = [Case("flash causal", _BUILD, dict(variant="flash causal", L=short), ("fwdbwd",))]
    for v in RECURRENCES:
        out += [Case(v, _BUILD, dict(variant=v, L=n), ("fwdbwd",)) for n in (short, long)]
    return out


def checks(r):
    quick = r.find("flash causal", "fwdbwd", L=SHORT) is None
    short, long = (QUICK_SHORT, QUICK_LONG) if quick else (SHORT, LONG)
    t = lambda name, n=short: r.time(name, "fwdbwd", L=n)  # noqa: E731
    out = [ratio_check(f"fwd+bwd speed-up of {v} over causal flash at L={short}",
                       t("flash causal"), t(v), at_least=3) for v in RECURRENCES]
    for v in RECURRENCES:
        out.append(ratio_check(f"{v} fwd+bwd time, L={long} / L={short}", t(v, long), t(v),
                               at_most=LONG_BOUND.get(v, 9)))
    # Not targets: the work itself, as the process's CPU time summed over its threads. Flash's
    # tile matmuls spread over every core; a recurrence's loop over chunks of 8 or 16
    # positions runs each step's small products on about one, so on a machine of few cores
    # the wall-time ratio falls short of the work's.
    cpu = lambda name: r.value("cpu_s", name, "fwdbwd", L=short)  # noqa: E731

    def cores(name):  # CPU time over wall time: the cores a call kept busy on average
        c, wall = cpu(name), t(name)
        return "n/a" if c is None or not wall else f"{c / wall:.2f}"

    for v in RECURRENCES:
        out.append(ratio_check(
            f"(why) CPU time of all threads, causal flash / {v}, fwd+bwd at L={short}; and the "
            f"cores each kept busy: flash {cores('flash causal')}, {v} {cores(v)}",
            cpu("flash causal"), cpu(v), at_least=3))
    return out
