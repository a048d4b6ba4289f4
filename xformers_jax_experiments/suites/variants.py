"""Suite ``variants``: attention with priors and multi-head variants.

* Average attention decoding (Zhang et al., 2018): 32 ``CausalLM.decode_step`` calls (2
  layers, d=256, 4 heads) from position 100 and from position 4000 (the caches fed with that
  many tokens first); the state is a running sum and count, so a step should cost the same at
  both positions (within 1.2x).
* Realformer's residual scores on the tiled kernel (layer ``n`` attends with the ``n`` layers'
  queries and keys concatenated: ``(n + 1) / 2`` times flash's FLOPs) and talking heads' tiled
  form (``H`` attentions over concatenated heads: ``H`` times flash's FLOPs), each against
  plain flash attention at the same size, and against their dense forms. fp32, B=1, H=4,
  D=64, non-causal.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

import xformers_jax.attention as A
import xformers_jax.models as models
import xformers_jax.nn as nn
from xformers_jax_experiments.bench_lib import Case, Results, Workload, ratio_check
from xformers_jax_experiments.suites.attention import attention_flops, qkv

TITLE = ("Priors and multi-head variants: average-attention decoding, Realformer and "
         "talking heads on the tiled kernel vs flash (fp32, B=1, H=4, D=64)")
_BUILD = "xformers_jax_experiments.suites.variants:build"
POSITIONS = (100, 4000)
STEPS = 32
LENGTHS = (1024, 2048)


def _decode(position: int):
    model = models.CausalLM(256, 256, 2, 4, 1024, max_len=4096 + 8,
                        block=dict(spec=nn.AttentionSpec("average")), key=jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, position), 0, 256)
    caches = model.init_cache(1, 4096 + 8)
    _, caches = eqx.filter_jit(model.prefill)(tokens, caches)
    def steps(toks, caches):
        # STEPS decode steps from ``position`` (one call: timing a single ~2 ms step in a
        # fresh process on a loaded machine was dominated by scheduling noise).
        def one(caches, inputs):
            tok, t = inputs
            logits, caches = model.decode_step(tok, caches, t)
            return caches, logits[:, 0]

        return jax.lax.scan(one, caches, (toks.T, position + jnp.arange(STEPS)))[1]

    toks = jax.random.randint(jax.random.PRNGKey(2), (1, STEPS), 0, 256)
    return Workload(steps, (toks, caches))


def build(variant: str, L: int = 1024, n: int = 2, position: int = 100, B: int = 1, H: int = 4,
          D: int = 64):
    if variant == "average decode":
        return _decode(position)
    q, k, v = qkv(L, B, H, D)
    flops = attention_flops(L, B, H, D)
    if variant == "flash":
        f = A.multihead(A.flash_attention)
        return Workload(lambda q, k, v: f(q, k, v), (q, k, v), flops=flops)
    if variant in ("realformer tiled", "realformer dense"):
        key = jax.random.PRNGKey(3)
        qs = jax.random.normal(key, (n, B, L, H, D))
        ks = jax.random.normal(jax.random.fold_in(key, 1), (n, B, L, H, D))
        per = lambda qs, ks, v: A.realformer_flash_attention(qs, ks, v)  # noqa: E731
        if variant == "realformer tiled":
            one = per
        else:   # the dense chain's last layer: the summed scores carried in, then one layer
            def one(qs, ks, v):
                s = sum(qs[m] @ ks[m].T / D ** 0.5 for m in range(n - 1))
                return A.realformer_attention(qs[-1], ks[-1], v, s)[0]
        f = jax.vmap(jax.vmap(one, in_axes=(2, 2, 1), out_axes=1), in_axes=(1, 1, 0))
        return Workload(f, (qs, ks, v), flops=flops)
    if variant in ("talking tiled", "talking dense"):
        impl = "tiled" if variant == "talking tiled" else "dense"
        key = jax.random.PRNGKey(4)
        p_l = jnp.eye(H) + 0.1 * jax.random.normal(key, (H, H))
        p_w = jnp.eye(H) + 0.1 * jax.random.normal(jax.random.fold_in(key, 1), (H, H))
        f = jax.vmap(lambda q, k, v, a, b: A.talking_heads_attention(
            q, k, v, a, b, implementation=impl), in_axes=(0, 0, 0, None, None))
        return Workload(f, (q, k, v, p_l, p_w), flops=flops)
    raise ValueError(f"variants suite: unknown variant {variant!r}")


def cases(quick: bool) -> list[Case]:
    out = [Case("average decode", _BUILD, dict(variant="average decode", position=p), ("fwd",))
           for p in ((10, 200) if quick else POSITIONS)]
    for L in ((128,) if quick else LENGTHS):
        out.append(Case("flash", _BUILD, dict(variant="flash", L=L)))
        for n in (2, 4):
            out.append(Case("realformer tiled", _BUILD, dict(variant="realformer tiled", L=L,
                                                             n=n)))
        out.append(Case("realformer dense", _BUILD, dict(variant="realformer dense", L=L, n=4)))
        out.append(Case("talking tiled", _BUILD, dict(variant="talking tiled", L=L)))
        out.append(Case("talking dense", _BUILD, dict(variant="talking dense", L=L)))
    return out


def checks(r: Results):
    quick = r.find("average decode", "fwd", position=POSITIONS[0]) is None
    p0, p1 = (10, 200) if quick else POSITIONS
    L = 128 if quick else LENGTHS[-1]
    out = [ratio_check(f"average-attention decode time per token, from token {p1} / from "
                       f"token {p0}",
                       r.time("average decode", "fwd", position=p1),
                       r.time("average decode", "fwd", position=p0), at_most=1.2)]
    for mode in ("fwd", "fwdbwd"):
        flash = r.time("flash", mode, L=L)
        for n in (2, 4):
            out.append(ratio_check(
                f"Realformer tiled (layer {n}) / flash {mode} time at L={L} (FLOP ratio "
                f"{(n + 1) / 2:.1f})", r.time("realformer tiled", mode, L=L, n=n), flash,
                at_most=(n + 1) / 2 * 1.25))
        out.append(ratio_check(f"talking heads tiled / flash {mode} time at L={L} (FLOP ratio "
                               "4)", r.time("talking tiled", mode, L=L), flash, at_most=5.0))
        out.append(ratio_check(f"talking heads tiled / dense {mode} compiled memory at L={L}",
                               r.value("compiled_mb", "talking tiled", mode, L=L),
                               r.value("compiled_mb", "talking dense", mode, L=L),
                               at_most=1.0))
        out.append(ratio_check(f"Realformer tiled / dense (layer 4) {mode} compiled memory at "
                               f"L={L}", r.value("compiled_mb", "realformer tiled", mode, L=L,
                                                 n=4),
                               r.value("compiled_mb", "realformer dense", mode, L=L, n=4),
                               at_most=1.0))
    return out
