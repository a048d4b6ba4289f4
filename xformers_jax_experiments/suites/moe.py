"""Suite ``moe``: mixture-of-experts dispatch and product-key memory (fp32, d=256).

MoE: 16K tokens, 8 experts of MLP width 1024, top-2. ``dropless`` is ``experts.moe_dropless``
with the default backend (on CPU the whole MLP in MegaBlocks' padded 128-row block layout,
``experts._dispatch._dropless_tiled``; ``jax.lax.ragged_dot`` elsewhere); ``capacity`` fills
per-expert buffers at capacity factor 1.25; ``all experts`` computes every expert on every token and
weights by the (sparse) gates; ``dense 2048`` is a dense FFN with the same active parameters
(MLP 2048 = 2 x 1024). The figures: dropless fwd+bwd at most 1.3x the dense FFN and at least
3x faster than all experts.

Product-key memory (Lample et al., 2019): 4K tokens, 2 heads, k=32 slots per head, query
width 128, values of width 256, N = 128^2 and 512^2 rows; compared with a dense FFN of the
same width (256 -> 1024 -> 256) on the same tokens. The figures: fwd+bwd within 2x of the
dense FFN at N=512^2, and N=128^2 vs 512^2 within 1.3x. Bounds (the "(why)" rows): the
512^2 forward alone against the dense FFN's fwd+bwd (a fwd+bwd takes at least its forward),
and the selection alone (``product_key_topk``: sub-key scores, XLA's ``top_k`` over each half
and over the candidates), timed as its own case.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xformers_jax import experts as M
from xformers_jax_experiments.bench_lib import Case, Results, Workload, ratio_check

TITLE = "Mixture of experts and product-key memory (fp32, d=256)"
_BUILD = "xformers_jax_experiments.suites.moe:build"
D, E, K, EXPERT_MLP = 256, 8, 2, 1024
TOKENS, QUICK_TOKENS = 16384, 1024
PKM_TOKENS, PKM_QUICK_TOKENS = 4096, 512
PKM_HEADS, PKM_K, PKM_KEY_DIM = 2, 32, 128


def _dense(x, w1, w2):
    return jax.nn.gelu(x @ w1) @ w2


def build(variant: str, T: int, N: int = 0):
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    x = jax.random.normal(keys[0], (T, D))
    if variant.startswith("dense"):
        hidden = int(variant.split()[1])
        w1 = jax.random.normal(keys[1], (D, hidden)) / D ** 0.5
        w2 = jax.random.normal(keys[2], (hidden, D)) / hidden ** 0.5
        return Workload(_dense, (x, w1, w2), flops=4.0 * T * D * hidden)
    if variant.startswith("product key"):
        n = int(round(N ** 0.5))
        wq = jax.random.normal(keys[1], (D, PKM_HEADS * PKM_KEY_DIM)) / D ** 0.5
        k1 = jax.random.normal(keys[2], (PKM_HEADS, n, PKM_KEY_DIM // 2))
        k2 = jax.random.normal(keys[3], (PKM_HEADS, n, PKM_KEY_DIM // 2))
        values = jax.random.normal(keys[4], (n * n, D)) / D ** 0.5

        def pkm(x, wq, k1, k2, values):
            q = (x @ wq).reshape(T, PKM_HEADS, PKM_KEY_DIM)
            return M.product_key_lookup(q, k1, k2, values, PKM_K)

        if variant == "product key top-k":  # the selection alone: sub-key scores and top-k
            def select(x, wq, k1, k2):
                q = (x @ wq).reshape(T, PKM_HEADS, PKM_KEY_DIM)
                return M.product_key_topk(q, k1, k2, PKM_K)

            return Workload(select, (x, wq, k1, k2))

        flops = 2.0 * T * (D * PKM_HEADS * PKM_KEY_DIM + PKM_HEADS * n * PKM_KEY_DIM
                           + PKM_HEADS * PKM_K * D)
        return Workload(pkm, (x, wq, k1, k2, values), flops=flops)
    wr = jax.random.normal(keys[1], (D, E)) * 0.1
    w = M.init_expert_weights(keys[2], E, D, EXPERT_MLP)
    flops = 4.0 * T * K * D * EXPERT_MLP

    def route(x, wr):
        return M.top_k_route(M.router_logits(x, wr), K)

    if variant == "dropless":
        def fn(x, wr, w1, w2):
            return M.moe_dropless(x, route(x, wr), M.ExpertWeights(w1, w2))
    elif variant == "capacity":
        def fn(x, wr, w1, w2):
            return M.moe_capacity(x, route(x, wr), M.ExpertWeights(w1, w2),
                                  capacity_factor=1.25)[0]
    elif variant == "all experts":
        def fn(x, wr, w1, w2):
            r = route(x, wr)
            gates = jnp.zeros((T, E)).at[jnp.arange(T)[:, None], r.experts].set(r.gates)
            h = jax.nn.gelu(jnp.einsum("td,edh->eth", x, w1))
            return jnp.einsum("eth,ehd,te->td", h, w2, gates)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return Workload(fn, (x, wr, w.w1, w.w2), flops=flops)


def cases(quick: bool) -> list[Case]:
    t = QUICK_TOKENS if quick else TOKENS
    tp = PKM_QUICK_TOKENS if quick else PKM_TOKENS
    out = [Case(v, _BUILD, dict(variant=v, T=t), ("fwd", "fwdbwd"))
           for v in ("dense 2048", "dropless", "capacity", "all experts")]
    out.append(Case("dense 1024", _BUILD, dict(variant="dense 1024", T=tp), ("fwd", "fwdbwd")))
    for n in (128 ** 2, 512 ** 2):
        out.append(Case("product key", _BUILD, dict(variant="product key", T=tp, N=n),
                        ("fwd", "fwdbwd")))
    out.append(Case("product key top-k", _BUILD,
                    dict(variant="product key top-k", T=tp, N=512 ** 2), ("fwd",)))
    return out


def checks(r: Results):
    quick = r.find("dropless", "fwdbwd", T=TOKENS) is None
    t = QUICK_TOKENS if quick else TOKENS
    tp = PKM_QUICK_TOKENS if quick else PKM_TOKENS
    dropless = r.time("dropless", "fwdbwd", T=t)
    pkm_big = r.time("product key", "fwdbwd", T=tp, N=512 ** 2)
    dense = r.time("dense 1024", "fwdbwd", T=tp)
    topk = r.time("product key top-k", "fwd", T=tp, N=512 ** 2)
    return [
        ratio_check(f"dropless MoE (8 experts, top-2, MLP 1024) fwd+bwd / dense FFN MLP 2048, "
                    f"{t} tokens", dropless, r.time("dense 2048", "fwdbwd", T=t), at_most=1.3),
        ratio_check(f"all experts on every token / dropless MoE fwd+bwd, {t} tokens",
                    r.time("all experts", "fwdbwd", T=t), dropless, at_least=3.0),
        ratio_check(f"capacity (factor 1.25) / dropless fwd+bwd, {t} tokens (why)",
                    r.time("capacity", "fwdbwd", T=t), dropless, at_most=10.0),
        ratio_check(f"product-key memory N=512^2 / dense FFN 256-1024-256 fwd+bwd, {tp} tokens",
                    pkm_big, dense, at_most=2.0),
        ratio_check(f"product-key memory fwd+bwd N=512^2 / N=128^2, {tp} tokens", pkm_big,
                    r.time("product key", "fwdbwd", T=tp, N=128 ** 2), at_most=1.3),
        ratio_check(f"(why) product-key memory forward alone N=512^2 / dense FFN fwd+bwd, {tp} "
                    "tokens (a fwd+bwd takes at least its forward)",
                    r.time("product key", "fwd", T=tp, N=512 ** 2), dense, at_least=0.0),
        ratio_check(f"(why) product-key top-k alone (sub-key scores, both halves' top-k and the "
                    f"candidates'; forward) N=512^2 / dense FFN fwd+bwd, {tp} tokens", topk,
                    dense, at_least=0.0),
    ]
