"""Memory-efficient exact attention: ``flash_attention`` and ``block_sparse_attention``.

Both are the same tiled online-softmax kernel (``xformers_jax.kernels.attend_layout``) reading a
:class:`~xformers_jax.attention.patterns.BlockLayout`: flash attention uses the layout of the
full or causal pattern (optionally intersected with one you give), block-sparse attention the
layout you give. See ``xformers_jax.kernels`` for the algorithm and its references.
"""

from __future__ import annotations

import functools

import numpy as np
from jaxtyping import Array, Bool, Float

from . import _contract as C
from .. import kernels
from ..kernels import attend_layout
from ._dense import combined_pattern
from .patterns import BlockLayout, Full, Pattern

# Tile sizes for the XLA path when the machine's table is not used (ring attention, and the
# fallback table's cheapest size): larger tiles amortise the scan's per-step cost, smaller ones
# skip more of a causal or banded matrix. flash_attention's default for full and causal
# attention is the machine's cheapest tile, ``kernels.kernels.default_block()``.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


def _block(name: str, arg: str, value, length: int, default: int) -> int:
    if value is None:
        # As few tiles as the default size allows, of equal size rounded up to a multiple of
        # 8: a short sequence is one tile, and a length just past a multiple of the default
        # (4097 = 4096 + a CLS token) pads by a few rows per tile, not by a whole extra tile
        # (9 tiles of 456 rather than 9 of 512: 4104 rows, not 4608).
        tiles = -(-length // default)
        return -(-(-(-length // tiles)) // 8) * 8
    return C.check_positive_int(name, arg, value)


# Relative cost per score element of one computed square tile, by tile size: this machine's
# table (``kernels.kernels.tile_costs()``: measured once and cached, or the override in
# XFORMERS_JAX_TILES). Smaller tiles cost more per element (more scan steps, smaller matmuls;
# 512 x 512 tiles also take the transposed backward) but skip more of a sparse pattern. The
# fixed fallback, measured on a 2-core AMD EPYC: flash_attention fwd+bwd over Full() at
# L=2048 (H=4, D=64) took 311, 234, 189 and 112 ms with 64, 128, 256 and 512 tiles.
_TILE_COST = kernels.DEFAULT_TILE_COST


def pattern_tile(pattern: Pattern, lq: int, lk: int) -> int:
    """The square tile size of the machine's tile cost table that computes ``pattern`` at
    least cost (``kernels.kernels.tile_costs()``; ``_TILE_COST`` is the fixed fallback).

    Cost is the area of the tiles the pattern leaves non-empty times the tile size's cost per
    element. The non-empty tiles of every size come from one evaluation of the pattern on the
    finest grid, OR-pooled. With the fixed table on the 2-core CPU at L=8192, fwd+bwd, H=4,
    D=64, its choice was the fastest tiling measured: 256 for ``Local(256, 256)`` (301 ms,
    against 355, 328 and 347 at 64, 128 and 512), 128 for ``Local(128, 128)`` (209 against
    222, 317 and 373) and 64 for ``BigBird(64)`` (431 ms against 796 at 128 and 1974 at 512);
    the full and causal patterns keep 512 there.
    """
    return _pattern_tile(pattern, lq, lk, tuple(kernels.tile_costs().items()))


@functools.lru_cache(maxsize=256)
def _pattern_tile(pattern: Pattern, lq: int, lk: int, table: tuple) -> int:
    costs = dict(table)
    base = min(costs)
    nonempty = np.asarray(pattern.block_kinds(lq, lk, base, base)) != 0
    best_cost, best = None, None
    for tile in sorted(costs, reverse=True):
        f = tile // base
        nq, nk = -(-nonempty.shape[0] // f), -(-nonempty.shape[1] // f)
        pooled = np.zeros((nq * f, nk * f), bool)
        pooled[: nonempty.shape[0], : nonempty.shape[1]] = nonempty
        count = int(pooled.reshape(nq, f, nk, f).any(axis=(1, 3)).sum())
        cost = count * min(tile, lq) * min(tile, lk) * costs[tile]
        if best_cost is None or cost < best_cost:
            best_cost, best = cost, tile
    return best


def _pattern_blocks(name, pattern: Pattern, lq: int, lk: int, block_q, block_k):
    """Tile sizes for a pattern: the caller's, else equal tiles of about ``pattern_tile``."""
    tile = pattern_tile(pattern, lq, lk) if block_q is None or block_k is None else None
    return (_block(name, "block_q", block_q, lq, tile or kernels.default_block()),
            _block(name, "block_k", block_k, lk, tile or kernels.default_block()))


def _run(name, x, layout, *, kv_mask, segs, bias, scale, dropout_rate, key, return_lse,
         implementation, causal, flex=None, op=None):
    """Runs the chosen kernel; ``flex``: flex attention's kernel arguments (``score_mod``,
    ``mask_mod``, ``sink``, ``index``: see ``kernels.attend_layout``), taken by the XLA path
    and the Pallas kernels whose ``unsupported`` does not refuse them; ``op``: the kernel
    registry's operation (default ``name``)."""
    flex = flex or {}
    call = dict(
        lq=x.lq, lk=x.lk, dk=x.dk, dv=x.dv, dtype=x.q.dtype, layout=layout, causal=causal,
        has_kv_mask=kv_mask is not None, has_segments=segs is not None,
        bias=("none" if bias is None else "callable" if callable(bias) else "array"),
        dropout_rate=dropout_rate,
        flex=tuple(n for n in ("score_mod", "mask_mod", "sink") if flex.get(n) is not None),
    )
    if implementation != "xla" and (flex.get("score_mod") or flex.get("mask_mod")):
        call["flex_primitives"] = kernels.flex_primitives(
            flex.get("score_mod"), flex.get("mask_mod"), layout.block_q, layout.block_k)
    if implementation != "xla":
        import pallas_kernels  # noqa: F401  registers the Pallas kernels; loaded only when asked

    kernel = kernels.choose(op or name, implementation, call)
    if kernel is not None:
        out, lse = kernel(
            x.q, x.k, x.v, layout, kv_mask=kv_mask, segments=segs, bias=bias, scale=scale,
            dropout_rate=dropout_rate, key=key, **flex,
        )
    else:
        out, lse = attend_layout(
            x.q, x.k, x.v, layout, kv_mask=kv_mask, segments=segs, bias=bias, scale=scale,
            dropout_rate=dropout_rate, key=key, **flex,
        )
    return (out, lse) if return_lse else out


def flash_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    bias=None,
    pattern: Pattern | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    key=None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
) -> Float[Array, "q_seq v_dim"] | tuple[Float[Array, "q_seq v_dim"], Float[Array, "q_seq"]]:
    """Exact softmax attention in O(L) memory, without the ``[Lq, Lk]`` score matrix.

    Equal to :func:`dot_product_attention` with the same arguments (up to float rounding),
    gradients included. Tiles the pattern leaves empty are skipped, so ``causal=True`` does
    about half the work and ``pattern=Local(w, w)`` work proportional to ``w``. A query that
    sees no key gets zeros and finite gradients.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``. Any lengths (tiles are padded).
      causal: query i sees keys ``j <= i`` only.
      kv_mask: ``bool[Lk]``, True for real keys (data-dependent padding).
      segment_ids: ``int[L]`` or ``(int[Lq], int[Lk])`` for packed sequences. On the XLA
        path a tile whose query and key id ranges cannot meet is skipped, forward and
        backward (ids sorted by position, as packing lays them out, skip all but the
        documents' own tiles; any ids stay exact).
      bias: an array ``[Lq, Lk]``, or a callable ``bias(q_pos [bq, 1], k_pos [1, bk])`` evaluated
        per tile so no ``L x L`` array is built; gradients reach an array bias and any arrays
        the callable closes over or holds (e.g. an ``eqx.Module``).
      pattern: a static :class:`~xformers_jax.attention.patterns.Pattern`, intersected with
        the causal mask when ``causal``.
      scale: score scale, ``1/sqrt(Dk)`` by default.
      dropout_rate, key: attention dropout, identical to the reference's for the same key.
      block_q, block_k: tile sizes. By default the machine's cheapest tile per score element
        (``kernels.tile_costs``: measured once and cached; 512 in the fixed fallback), or with
        a ``pattern`` the size :func:`pattern_tile` finds cheapest for it.
      return_lse: also return the float32 log-sum-exp of each query's scores (-inf for a query
        that sees no key).
      implementation: ``None`` (fastest available), ``"xla"``, ``"pallas"`` or a registered
        kernel's name (``pallas_kernels.kernels_for(op)``; e.g. ``"pallas_gpu_mosaic"``).

    Returns:
      ``[Lq, Dv]`` in q's dtype, or ``(out, lse)``.
    """
    name = "flash_attention"
    x, kv_mask, segs, bias, scale = C.check_softmax_args(
        name, q, k, v, kv_mask, segment_ids, bias, dropout_rate, key, scale
    )
    if pattern is None:
        # Full or causal: the machine's cheapest tile per element (512 in the fallback table).
        bq = _block(name, "block_q", block_q, x.lq, kernels.default_block())
        bk = _block(name, "block_k", block_k, x.lk, kernels.default_block())
        pattern = combined_pattern(name, None, causal) or Full()
    else:
        pattern = combined_pattern(name, pattern, causal)
        bq, bk = _pattern_blocks(name, pattern, x.lq, x.lk, block_q, block_k)
    layout = pattern.layout(x.lq, x.lk, bq, bk)
    return _run(name, x, layout, kv_mask=kv_mask, segs=segs, bias=bias, scale=scale,
                dropout_rate=dropout_rate, key=key, return_lse=return_lse,
                implementation=implementation, causal=causal)


def block_sparse_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    layout: BlockLayout | Pattern,
    *,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    bias=None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    key=None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
) -> Float[Array, "q_seq v_dim"] | tuple[Float[Array, "q_seq v_dim"], Float[Array, "q_seq"]]:
    """Exact softmax attention over only the tiles a block layout keeps.

    Time and memory are proportional to the number of non-empty tiles. ``layout`` is a
    :class:`BlockLayout` (its tiling is used as is) or a ``Pattern`` (tiled with ``block_q``,
    ``block_k``; by default with the tile size :func:`pattern_tile` finds cheapest for the
    pattern, e.g. 64 for ``BigBird(64)``). Other arguments are those of
    :func:`flash_attention`; ``causal=True`` needs a pattern (a layout's tiles are fixed), or a
    causal-safe layout.
    """
    name = "block_sparse_attention"
    x, kv_mask, segs, bias, scale = C.check_softmax_args(
        name, q, k, v, kv_mask, segment_ids, bias, dropout_rate, key, scale
    )
    if isinstance(layout, Pattern):
        pattern = combined_pattern(name, layout, causal)
        bq, bk = _pattern_blocks(name, pattern, x.lq, x.lk, block_q, block_k)
        layout = pattern.layout(x.lq, x.lk, bq, bk)
    elif isinstance(layout, BlockLayout):
        if (layout.lq, layout.lk) != (x.lq, x.lk):
            raise ValueError(
                f"{name}: the layout was built for (lq, lk) = ({layout.lq}, {layout.lk}) but "
                f"q{tuple(x.q.shape)}, k{tuple(x.k.shape)} give ({x.lq}, {x.lk})"
            )
        if causal and _sees_future(layout):
            raise ValueError(
                f"{name}: causal=True but {layout!r} lets some query see a later key; build the "
                "layout from a causal pattern (pattern & Causal())"
            )
    else:
        raise ValueError(
            f"{name}: layout must be a BlockLayout or a Pattern, got {type(layout).__name__}"
        )
    return _run(name, x, layout, kv_mask=kv_mask, segs=segs, bias=bias, scale=scale,
                dropout_rate=dropout_rate, key=key, return_lse=return_lse,
                implementation=implementation, causal=causal)


def _sees_future(layout: BlockLayout) -> bool:
    """True if some query of ``layout`` sees a key at a later position."""
    return bool(np.triu(layout.dense(), k=1).any())
