"""Memory-efficient exact attention: ``flash_attention`` and ``block_sparse_attention``.

Both are the same tiled online-softmax kernel (``_blocksparse``) reading a
:class:`~xformers_jax.attention.patterns.BlockLayout`: flash attention uses the layout of the
full or causal pattern (optionally intersected with one you give), block-sparse attention the
layout you give. See ``_blocksparse`` for the algorithm and its references.
"""

from __future__ import annotations

import numpy as np

from . import _contract as C
from . import _dispatch
from ._blocksparse import attend_layout
from ._dense import combined_pattern
from .patterns import BlockLayout, Full, Pattern

# Tile sizes for the XLA path, chosen by experiments/benchmark.py --suite=attention on a 2-core
# CPU: larger tiles amortise the scan's per-step cost, smaller ones skip more of a causal or
# banded matrix.
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


def _run(name, x, layout, *, kv_mask, segs, bias, scale, dropout_rate, key, return_lse,
         implementation, causal):
    call = dict(
        lq=x.lq, lk=x.lk, dk=x.dk, dv=x.dv, dtype=x.q.dtype, layout=layout, causal=causal,
        has_kv_mask=kv_mask is not None, has_segments=segs is not None,
        bias=("none" if bias is None else "callable" if callable(bias) else "array"),
        dropout_rate=dropout_rate,
    )
    kernel = _dispatch.choose(name, implementation, call)
    if kernel is not None:
        out, lse = kernel(
            x.q, x.k, x.v, layout, kv_mask=kv_mask, segments=segs, bias=bias, scale=scale,
            dropout_rate=dropout_rate, key=key,
        )
    else:
        out, lse = attend_layout(
            x.q, x.k, x.v, layout, kv_mask=kv_mask, segments=segs, bias=bias, scale=scale,
            dropout_rate=dropout_rate, key=key,
        )
    return (out, lse) if return_lse else out


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    kv_mask=None,
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
):
    """Exact softmax attention in O(L) memory, without the ``[Lq, Lk]`` score matrix.

    Equal to :func:`dot_product_attention` with the same arguments (up to float rounding),
    gradients included. Tiles the pattern leaves empty are skipped, so ``causal=True`` does
    about half the work and ``pattern=Local(w, w)`` work proportional to ``w``. A query that
    sees no key gets zeros and finite gradients.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``. Any lengths (tiles are padded).
      causal: query i sees keys ``j <= i`` only.
      kv_mask: ``bool[Lk]``, True for real keys (data-dependent padding).
      segment_ids: ``int[L]`` or ``(int[Lq], int[Lk])`` for packed sequences.
      bias: an array ``[Lq, Lk]``, or a callable ``bias(q_pos [bq, 1], k_pos [1, bk])`` evaluated
        per tile so no ``L x L`` array is built; gradients reach an array bias and any arrays
        the callable closes over or holds (e.g. an ``eqx.Module``).
      pattern: a static :class:`~xformers_jax.attention.patterns.Pattern`, intersected with
        the causal mask when ``causal``.
      scale: score scale, ``1/sqrt(Dk)`` by default.
      dropout_rate, key: attention dropout, identical to the reference's for the same key.
      block_q, block_k: tile sizes (defaults tuned for CPU; see ``DEFAULT_BLOCK_Q``).
      return_lse: also return the float32 log-sum-exp of each query's scores (-inf for a query
        that sees no key).
      implementation: ``None`` (fastest available), ``"xla"`` or ``"pallas"``.

    Returns:
      ``[Lq, Dv]`` in q's dtype, or ``(out, lse)``.
    """
    name = "flash_attention"
    x, kv_mask, segs, bias, scale = C.check_softmax_args(
        name, q, k, v, kv_mask, segment_ids, bias, dropout_rate, key, scale
    )
    bq = _block(name, "block_q", block_q, x.lq, DEFAULT_BLOCK_Q)
    bk = _block(name, "block_k", block_k, x.lk, DEFAULT_BLOCK_K)
    pattern = combined_pattern(name, pattern, causal) or Full()
    layout = pattern.layout(x.lq, x.lk, bq, bk)
    return _run(name, x, layout, kv_mask=kv_mask, segs=segs, bias=bias, scale=scale,
                dropout_rate=dropout_rate, key=key, return_lse=return_lse,
                implementation=implementation, causal=causal)


def block_sparse_attention(
    q,
    k,
    v,
    layout: BlockLayout | Pattern,
    *,
    causal: bool = False,
    kv_mask=None,
    segment_ids=None,
    bias=None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    key=None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
):
    """Exact softmax attention over only the tiles a block layout keeps.

    Time and memory are proportional to the number of non-empty tiles. ``layout`` is a
    :class:`BlockLayout` (its tiling is used as is) or a ``Pattern`` (tiled with ``block_q``,
    ``block_k``). Other arguments are those of :func:`flash_attention`; ``causal=True`` needs a
    pattern (a layout's tiles are fixed), or a causal-safe layout.
    """
    name = "block_sparse_attention"
    x, kv_mask, segs, bias, scale = C.check_softmax_args(
        name, q, k, v, kv_mask, segment_ids, bias, dropout_rate, key, scale
    )
    if isinstance(layout, Pattern):
        bq = _block(name, "block_q", block_q, x.lq, DEFAULT_BLOCK_Q)
        bk = _block(name, "block_k", block_k, x.lk, DEFAULT_BLOCK_K)
        layout = combined_pattern(name, layout, causal).layout(x.lq, x.lk, bq, bk)
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
