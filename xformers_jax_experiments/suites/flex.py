"""Suite ``flex``: flex attention's score and mask functions against plain flash attention and
the same patterns written by hand (Dong et al., 2024, "Flex Attention").

fp32, B=1, H=4, D=64, lifted with ``multihead``, XLA:CPU; L = 2048 and 8192 (the issue asks
2K-16K; 16K is left out on CPU to keep the suite within minutes). Cases:

- flash full and causal: the baselines (``flash_attention``, the same tiled kernel).
- ALiBi and Gemma's soft-cap as score functions, causal (``alibi_score``, ``soft_cap_score``).
- a mask function of about 10% block density, ``|i - j| <= L/20`` as a ``MaskMod`` (its layout
  derived by evaluating it), against the same band as the hand pattern ``Local(L/20, L/20)``.
- 8 packed documents of L/8 in one row, ``document_mask(ids) & Causal()``, against causal flash
  over the whole row.
- the same row as the trainer packs it: causal flash with the document ids as run-time data
  (``segment_ids``, an argument of the compiled function), whose tiles are skipped from the
  ids' ranges per tile rather than from a static layout.
- the host-side work of a static mask function (``pattern_tile``, then its layout at that
  tile): for a new function each call (a fresh build: compiling and evaluating the function
  at every position, paid once per function and shape) and for one function called again
  (cached). The issue asks "under 5% of one fwd+bwd at 8K, or cached": the figure is the
  cached call's, with the fresh build stated beside it.

- the band's and the documents' non-empty tiles at the kernel's tile, every one full (no
  in-tile mask: a mask function of tile indices): the measured ceilings of those two figures
  (the (why) rows "all full"), what the kernel's walk over that many tiles costs with nothing
  of the mask left to pay.

The (why) ceiling figures time nothing: they are the speed-ups a perfect
skip of empty tiles would give at the tiles the kernel picks (``pattern_tile``, this machine's
tile cost table), the work of the baseline's layout over the case's, each tile weighed by its
size's cost per element. A 5x figure cannot be met above its ceiling: at 512 x 512 tiles the
~10% band (half-width L/20) leaves 46 of 256 tiles non-empty (18% block density; ceiling
5.57x, not 10x), and 8 causal documents of L/8 leave 24 tiles against causal's 136 (5.67x,
not 8x: the diagonal tiles are half masked in both). What a case measures below its ceiling is
per-tile overhead (the in-tile mask of partial tiles, the walk's steps, the O(L) work around
the walk) and noise; the measured ceilings separate the first from the rest.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from xformers_jax import kernels
from xformers_jax.attention import (
    alibi_score,
    block_sparse_attention,
    flash_attention,
    flex_attention,
    multihead,
    pattern_tile,
    soft_cap_score,
)
from xformers_jax.attention.patterns import Causal, Local, MaskMod, document_mask
from xformers_jax_experiments.bench_lib import (
    Case,
    Results,
    Workload,
    ratio_check,
    value_check,
)
from xformers_jax_experiments.suites.attention import attention_flops, qkv

TITLE = "Flex attention: score and mask functions vs flash and hand patterns (fp32, B=1, H=4, D=64)"
NOTE = ("XLA:CPU. Figures at L=8192: a score function within 1.15x of flash (causal), a 10% "
        "mask function 5x faster than full flash and within 10% of the hand pattern, 8 packed "
        "documents 5x faster than causal flash, a mask function's layout under 5% of one "
        "fwd+bwd once cached (a fresh build stated beside it). "
        "The (why) rows time nothing: the speed-up a perfect skip of empty tiles gives at the "
        "tiles the kernel picks (512 x 512 here: the ~10% band is 18% of the tiles, 8 causal "
        "documents 24 tiles against causal's 136), the most any kernel walking those tiles "
        "can reach; the (why) rows 'all full' measure the same tiles without their masks.")
_BUILD = "xformers_jax_experiments.suites.flex:build"
LENGTHS = (2048, 8192)
H = 4


def _band(L: int) -> int:
    return max(1, L // 20)


def _band_mask(L: int):
    w = _band(L)
    return MaskMod(lambda b, h, i, j: jnp.abs(i - j) <= w, ("band", w))


def _documents(L: int):
    """8 causal documents of L/8 (a static layout)."""
    return document_mask(np.repeat(np.arange(8), L // 8)) & Causal()


def build(variant: str, L: int, quick: bool = False, B: int = 1, D: int = 64):
    tiles = dict(block_q=16, block_k=16) if quick else {}
    flops = attention_flops(L, B, H, D, causal=True)
    if variant == "flash":
        fn, flops = (lambda q, k, v: flash_attention(q, k, v)), attention_flops(L, B, H, D)
    elif variant == "flash_causal":
        fn = lambda q, k, v: flash_attention(q, k, v, causal=True)
    elif variant == "alibi":
        slopes = jnp.asarray(2.0 ** (-8.0 * np.arange(1, H + 1) / H), jnp.float32)
        fn = lambda q, k, v, head_index: flex_attention(
            q, k, v, score_mod=alibi_score(slopes), causal=True, head_index=head_index)
    elif variant == "softcap":
        fn = lambda q, k, v: flex_attention(q, k, v, score_mod=soft_cap_score(50.0),
                                            causal=True)
    elif variant in ("mask10", "hand10"):
        band = _band_mask(L) if variant == "mask10" else Local(_band(L), _band(L))
        flops = attention_flops(L, B, H, D) * band.layout(L, L, 64, 64).dense().mean()
        if variant == "mask10":
            fn = lambda q, k, v: flex_attention(q, k, v, mask_mod=band, **tiles)
        else:
            fn = lambda q, k, v: block_sparse_attention(q, k, v, band, **tiles)
    elif variant in ("mask10_tiles", "documents_tiles"):
        # The same non-empty tiles as the band or the documents at the kernel's tile, every one
        # full (no in-tile mask): what the kernel's walk over that many tiles costs, the
        # practical ceiling of the case (its (why) figures).
        t = pattern_tile(_band_mask(L) if variant == "mask10_tiles" else _documents(L), L, L)
        tiles = dict(block_q=t, block_k=t) if not quick else tiles
        if variant == "mask10_tiles":
            n = -(-_band(L) // t)
            mask = MaskMod(lambda b, h, i, j: jnp.abs(i // t - j // t) <= n, ("band tiles", n, t))
        else:
            doc = L // 8
            mask = MaskMod(lambda b, h, i, j: (i // doc == j // doc) & (i // t >= j // t),
                           ("document tiles", doc, t))
        flops = attention_flops(L, B, H, D) * mask.layout(L, L, t, t).dense().mean()
        fn = lambda q, k, v: flex_attention(q, k, v, mask_mod=mask, **tiles)
    elif variant == "documents":
        mask = _documents(L)
        flops = attention_flops(L // 8, B, H, D, causal=True) * 8
        fn = lambda q, k, v: flex_attention(q, k, v, mask_mod=mask, **tiles)
    elif variant == "segments":
        ids = jnp.asarray(np.tile(np.repeat(np.arange(8), L // 8), (B, 1)), jnp.int32)
        lifted = multihead(lambda q, k, v, segment_ids: flash_attention(
            q, k, v, causal=True, segment_ids=segment_ids, **tiles))
        return Workload(lambda q, k, v, ids: lifted(q, k, v, segment_ids=ids),
                        (*qkv(L, B, H, D), ids),
                        flops=attention_flops(L // 8, B, H, D, causal=True) * 8)
    elif variant in ("layout", "layout_cached"):
        # The host-side work a flex_attention call does for a static mask function: its tile
        # (``pattern_tile`` evaluates it on the finest grid) and its layout at that tile.
        def host_work(mask):
            t = pattern_tile(mask, L, L)
            return mask.layout(L, L, t, t)

        if variant == "layout":  # a new function each call, so the caches never answer
            def fresh(mode):
                def make():
                    w = _band(L)
                    return host_work(MaskMod(lambda b, h, i, j: jnp.abs(i - j) <= w))
                return make
            return Workload(None, (), native=fresh)
        mask = _band_mask(L)  # one mask: built by the warm-up call, cached for the timed ones
        return Workload(None, (), native=lambda mode: lambda: host_work(mask))
    else:
        raise ValueError(f"unknown variant {variant!r}")
    if variant == "alibi":  # the head index reaches the score function through multihead
        lifted = multihead(fn)
        return Workload(lambda q, k, v: lifted(q, k, v, head_index=jnp.arange(H)),
                        qkv(L, B, H, D), flops=flops)
    return Workload(multihead(fn), qkv(L, B, H, D), flops=flops)


_NAMES = {
    "flash": "flash (full)", "flash_causal": "flash causal", "alibi": "flex ALiBi causal",
    "softcap": "flex soft-cap causal", "mask10": "flex mask function ~10%",
    "hand10": "hand pattern ~10%", "documents": "flex 8 documents",
    "segments": "flash 8 documents as segment ids", "layout": "layout of a fresh mask function",
    "layout_cached": "layout of a mask function, cached",
    "mask10_tiles": "(why) the band's tiles, all full", "documents_tiles":
        "(why) the documents' tiles, all full",
}


def cases(quick: bool) -> list[Case]:
    lengths = (64, 128) if quick else LENGTHS
    out = []
    for L in lengths:
        for variant, name in _NAMES.items():
            modes = ("fwd",) if variant.startswith("layout") else ("fwd", "fwdbwd")
            out.append(Case(name, _BUILD, dict(variant=variant, L=L, quick=quick), modes=modes))
    return out


def _work(pattern, L: int) -> float:
    """The cost of the tiles the kernel computes for ``pattern`` at length ``L`` (``None``:
    full attention at flash's default tile), in units of this machine's tile cost table: the
    non-empty tiles' score elements times their size's cost per element."""
    costs = kernels.tile_costs()
    if pattern is None:
        t = kernels.default_block()  # flash's tile where L is a multiple of it (2K-16K)
        n = -(-L // t)
        return float(n * n * t * t * costs[t])
    t = pattern_tile(pattern, L, L)
    return float(pattern.layout(L, L, t, t).num_nonempty * t * t * costs[t])


def _layout(pattern, L: int):
    t = pattern_tile(pattern, L, L)
    return pattern.layout(L, L, t, t)


def ceilings(L: int):
    """``(band, documents)``: the speed-ups over full and causal flash that skipping every
    empty tile and nothing else would give (see the module docstring)."""
    band = _work(None, L) / _work(_band_mask(L), L)
    documents = _work(Causal(), L) / _work(_documents(L), L)
    return band, documents


def checks(r: Results):
    L = 8192

    def t(variant, mode):
        return r.time(_NAMES[variant], mode, variant=variant, L=L, quick=False)

    out = []
    band_tiles = _layout(_band_mask(L), L).num_nonempty
    document_tiles = _layout(_documents(L), L).num_nonempty
    for mode, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
        for variant in ("alibi", "softcap"):
            out.append(ratio_check(f"{_NAMES[variant]} / flash causal, {label}, L={L}",
                                   t(variant, mode), t("flash_causal", mode), at_most=1.15))
        out += [
            ratio_check(f"flash full / flex mask function ~10%, {label}, L={L} (speed-up)",
                        t("flash", mode), t("mask10", mode), at_least=5.0),
            ratio_check(f"flex mask function / hand pattern ~10%, {label}, L={L}",
                        t("mask10", mode), t("hand10", mode), at_most=1.10),
            ratio_check(f"flash causal / flex 8 packed documents, {label}, L={L} (speed-up)",
                        t("flash_causal", mode), t("documents", mode), at_least=5.0),
            ratio_check(f"flash causal / 8 packed documents as traced segment ids, {label}, "
                        f"L={L} (speed-up)", t("flash_causal", mode), t("segments", mode),
                        at_least=5.0),
            # Measured ceilings: the same non-empty tiles at the same tile size, every one
            # full (no in-tile mask), walked by the same kernel.
            ratio_check(f"(why) flash full / the ~10% band's {band_tiles} tiles all full, "
                        f"{label}, L={L} (measured ceiling)", t("flash", mode),
                        t("mask10_tiles", mode), at_least=5.0),
            ratio_check(f"(why) flash causal / the 8 documents' {document_tiles} tiles all "
                        f"full, {label}, L={L} (measured ceiling)", t("flash_causal", mode),
                        t("documents_tiles", mode), at_least=5.0),
        ]
    band, documents = ceilings(L)
    out += [
        value_check(f"(why) ceiling for the ~10% mask function: full flash's tile work / the "
                    f"band's at the kernel's tiles, L={L} (perfect skip)", band, at_least=5.0,
                    fmt="{:.2f}x"),
        value_check(f"(why) ceiling for 8 packed documents: causal flash's tile work / the "
                    f"documents', L={L} (perfect skip)", documents, at_least=5.0,
                    fmt="{:.2f}x"),
    ]
    # The target is "under 5% of one fwd+bwd at 8K, or cached": the figure is a
    # cached call's host work (a mask function used again, e.g. at a re-trace), with a fresh
    # build (a new function's first call: its jit compilation and evaluation on every
    # position) stated beside it; the fresh build is paid once per function and shape.
    cached, fresh, step = t("layout_cached", "fwd"), t("layout", "fwd"), t("mask10", "fwdbwd")
    check = ratio_check(f"layout of a mask function, cached (a second call) / flex mask "
                        f"function fwd+bwd, L={L}", cached, step, at_most=0.05, fmt="{:.5f}x")
    if check.ok is not None and fresh is not None:
        check = dataclasses.replace(
            check, measured=f"{check.measured} (a fresh build: {fresh / step:.2f}x)")
    out.append(check)
    return out
