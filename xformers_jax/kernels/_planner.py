"""The host-side planner: kernel metadata computed once, at trace time, from a BlockLayout.

Every Pallas kernel here walks a *plan* rather than a layout. A plan re-tiles the layout to the
kernel's own block sizes (a kernel's tile rules differ per backend and rarely match the tile
the caller chose), then lists for each query block the key blocks it must visit and, for the
backward pass, for each key block the query blocks that see it:

* per row, the non-empty blocks with FULL ones first (no in-tile mask) then PARTIAL ones,
  padded to the longest row by repeating the last listed block. Kernels stop at the row's
  count; on TPU the repeated index means the pipeline issues no new copy for padding steps,
  so each step already names the next non-empty block to fetch;
* the de-duplicated partial masks, indexed per listed block;
* ``band``: when every partial tile is a band ``i - left <= j <= i + right`` (causal, local
  windows, their intersections), kernels evaluate the mask from positions and load no mask.

Splash attention's ``MaskInfo`` (``jax.experimental.pallas.ops.tpu.splash_attention``) is the
same idea; this planner reads our :class:`BlockLayout` so the XLA path and the kernels agree.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ._layout import BlockLayout
from ._layout import EMPTY, FULL, PARTIAL


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True, eq=False)
class Blocks:
    """A list of non-empty blocks per row of a block grid (one plan direction).

    Attributes:
      blocks: ``int32[rows, width]``: the listed blocks, FULL first, padded by repetition.
      mask_ids: ``int32[rows, width]``: the partial mask of each listed block, -1 for full.
      fetch_ids: ``int32[rows, width]``: ``mask_ids`` with -1 replaced by the previous id in
        the row (0 at first), the mask block a pipelined kernel copies at each step.
      counts: ``int32[rows]``: how many blocks are listed. full: ``int32[rows]``: how many of
        them are FULL.
      starts: ``int32[rows, 2]``: the first FULL and the first PARTIAL block of each row (0
        where there is none).
      runs: True when in every row the FULL blocks, and the PARTIAL ones, are consecutive
        (dense, causal, local windows): a kernel can then compute the ``t``-th listed block
        as ``starts + t`` instead of loading it, so its loads depend only on the loop step and
        can be issued ahead (software pipelining).
    """

    blocks: np.ndarray
    mask_ids: np.ndarray
    fetch_ids: np.ndarray
    counts: np.ndarray
    full: np.ndarray
    starts: np.ndarray
    runs: bool

    @property
    def width(self) -> int:
        return self.blocks.shape[1]


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Kernel metadata for one layout and one kernel tiling.

    Attributes:
      layout: the layout re-tiled to the kernel's tiles (the caller's own layout when the
        tiles already match). ``lq``, ``lk``, ``block_q``, ``block_k``, ``kinds``,
        ``mask_index`` and the tile counts ``nq``, ``nk`` are read from it.
      rows: key blocks per query block (forward, dq). cols: query blocks per key block (dk, dv).
      masks: ``bool[n, block_q, block_k]`` de-duplicated partial masks the kernels load: the
        layout's ``partial_masks``, or none when ``band``.
      band: ``(left, right)`` when partial tiles are evaluated from positions, else None.
    """

    layout: BlockLayout
    rows: Blocks
    cols: Blocks
    masks: np.ndarray
    band: tuple[int, int] | None

    lq = property(lambda self: self.layout.lq)
    lk = property(lambda self: self.layout.lk)
    block_q = property(lambda self: self.layout.block_q)
    block_k = property(lambda self: self.layout.block_k)
    kinds = property(lambda self: self.layout.kinds)
    mask_index = property(lambda self: self.layout.mask_index)
    nq = property(lambda self: self.layout.num_q_blocks)
    nk = property(lambda self: self.layout.num_k_blocks)

    @property
    def has_partial(self) -> bool:
        return bool((self.kinds == PARTIAL).any())


def _tile_of_layout(layout: BlockLayout, r0: int, c0: int, bq: int, bk: int) -> np.ndarray:
    """The layout's connectivity on rows ``r0:r0+bq``, columns ``c0:c0+bk`` (keys past lk
    and rows past lq are False)."""
    r = np.arange(r0, r0 + bq)
    c = np.arange(c0, c0 + bk)
    rb = np.minimum(r // layout.block_q, layout.num_q_blocks - 1)
    cb = np.minimum(c // layout.block_k, layout.num_k_blocks - 1)
    kd = layout.kinds[rb[:, None], cb[None, :]]
    m = kd == FULL
    if len(layout.partial_masks):
        mi = layout.mask_index[rb[:, None], cb[None, :]]
        pm = layout.partial_masks[
            np.maximum(mi, 0), (r % layout.block_q)[:, None], (c % layout.block_k)[None, :]
        ]
        m = m | ((kd == PARTIAL) & pm)
    return m & (c < layout.lk)[None, :] & (r < layout.lq)[:, None]


def retile(layout: BlockLayout, bq: int, bk: int):
    """The layout's ``(kinds, mask_index, partial_masks)`` for tiles ``bq x bk``.

    Exact: only tiles that straddle differently-kinded layout tiles are rebuilt elementwise.
    """
    lq, lk = layout.lq, layout.lk
    if (bq, bk) == (layout.block_q, layout.block_k):
        return layout.kinds, layout.mask_index, layout.partial_masks
    nq, nk = cdiv(lq, bq), cdiv(lk, bk)
    # Min and max of the layout kinds over the real positions each new tile covers.
    per_row = np.repeat(layout.kinds, layout.block_q, axis=0)[:lq]
    starts_q, starts_k = np.arange(0, lq, bq), np.arange(0, lk, bk)
    lo = np.minimum.reduceat(per_row, starts_q, axis=0)
    hi = np.maximum.reduceat(per_row, starts_q, axis=0)
    lo = np.minimum.reduceat(np.repeat(lo, layout.block_k, axis=1)[:, :lk], starts_k, axis=1)
    hi = np.maximum.reduceat(np.repeat(hi, layout.block_k, axis=1)[:, :lk], starts_k, axis=1)
    kinds = np.where(lo == FULL, FULL, np.where(hi == EMPTY, EMPTY, PARTIAL)).astype(np.int8)
    if lk % bk:
        kinds[:, -1] = np.where(kinds[:, -1] == FULL, PARTIAL, kinds[:, -1])
    mask_index = np.full((nq, nk), -1, np.int32)
    unique: dict[bytes, int] = {}
    masks = []
    for a, b in zip(*np.nonzero(kinds == PARTIAL)):
        m = _tile_of_layout(layout, a * bq, b * bk, bq, bk)
        real = m[: min(bq, lq - a * bq)]
        if not real.any():
            kinds[a, b] = EMPTY
            continue
        if real.all() and (b + 1) * bk <= lk:
            kinds[a, b] = FULL
            continue
        mask_index[a, b] = unique.setdefault(m.tobytes(), len(masks))
        if mask_index[a, b] == len(masks):
            masks.append(m)
    partial = np.stack(masks) if masks else np.zeros((0, bq, bk), bool)
    return kinds, mask_index, partial


def find_band(kinds, mask_index, masks, lq, lk, bq, bk) -> tuple[int, int] | None:
    """``(left, right)`` if every partial tile's real rows equal ``i - left <= j <= i + right``
    (and ``j < lk``), else None. The tightest such band is the only candidate."""
    qb, kb = np.nonzero(kinds == PARTIAL)
    if len(qb) == 0:
        return None
    di = np.arange(bq)[:, None]
    dj = np.arange(bk)[None, :]
    left = right = None
    for a, b in zip(qb, kb):
        m = masks[mask_index[a, b]][: min(bq, lq - a * bq)]
        diff = (b * bk - a * bq) + (dj - di)[: m.shape[0]]
        lo, hi = int(diff[m].min()), int(diff[m].max())
        left = -lo if left is None else max(left, -lo)
        right = hi if right is None else max(right, hi)
    for a, b in zip(qb, kb):
        rows = min(bq, lq - a * bq)
        i = a * bq + di[:rows]
        j = b * bk + dj
        want = (j >= i - left) & (j <= i + right) & (j < lk)
        if not np.array_equal(masks[mask_index[a, b]][:rows], want):
            return None
    return left, right


def _blocks(kinds: np.ndarray, mask_index: np.ndarray) -> Blocks:
    rows = kinds.shape[0]
    width = max(1, int(np.count_nonzero(kinds, axis=1).max(initial=0)))
    blocks = np.zeros((rows, width), np.int32)
    mask_ids = np.full((rows, width), -1, np.int32)
    fetch_ids = np.zeros((rows, width), np.int32)
    counts = np.zeros(rows, np.int32)
    full = np.zeros(rows, np.int32)
    starts = np.zeros((rows, 2), np.int32)
    runs = True
    for r in range(rows):
        f = np.flatnonzero(kinds[r] == FULL)
        p = np.flatnonzero(kinds[r] == PARTIAL)
        listed = np.concatenate([f, p]).astype(np.int32)
        n = len(listed)
        counts[r], full[r] = n, len(f)
        starts[r] = (f[0] if len(f) else 0, p[0] if len(p) else 0)
        runs = runs and bool((np.diff(f) == 1).all() and (np.diff(p) == 1).all())
        if n == 0:
            continue
        blocks[r, :n] = listed
        blocks[r, n:] = listed[-1]
        mask_ids[r, len(f) : n] = mask_index[r, p]
        mask_ids[r, n:] = mask_ids[r, n - 1]
        last = 0
        for t in range(width):
            last = mask_ids[r, t] if mask_ids[r, t] >= 0 else last
            fetch_ids[r, t] = last
    for arr in (blocks, mask_ids, fetch_ids, counts, full, starts):
        arr.setflags(write=False)
    return Blocks(blocks, mask_ids, fetch_ids, counts, full, starts, runs)


@functools.lru_cache(maxsize=256)
def plan(layout: BlockLayout, block_q: int, block_k: int) -> Plan:
    """The :class:`Plan` of ``layout`` for kernel tiles ``block_q x block_k`` (cached per
    layout object, which layouts are per pattern and shape)."""
    kinds, mask_index, masks = retile(layout, block_q, block_k)
    if (block_q, block_k) != (layout.block_q, layout.block_k):
        layout = BlockLayout(layout.lq, layout.lk, block_q, block_k, kinds, mask_index, masks)
    band = find_band(kinds, mask_index, masks, layout.lq, layout.lk, block_q, block_k)
    if band is not None:
        masks = np.zeros((0, block_q, block_k), bool)
    return Plan(
        layout=layout,
        rows=_blocks(kinds, mask_index),
        cols=_blocks(kinds.T, mask_index.T),
        masks=masks,
        band=band,
    )
