"""Masks as data: the pattern protocol.

A :class:`Pattern` is a small, hashable, numpy-side description of which keys each query may
see. It is never materialised at full size on the device. Kernels ask it for a
:class:`~xformers_jax.kernels.BlockLayout` (the kernel layer's description of which tiles are
empty, full or partial); the XLA tiled back end and the Pallas kernels read the same layout.

Patterns compose with ``|`` (union) and ``&`` (intersection).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import numpy as np

from ...kernels import EMPTY, FULL, PARTIAL, BlockLayout, cdiv

# Host-side evaluation of a generic pattern visits the mask in query-row chunks of about this
# many elements, so building a layout never holds the whole L x L matrix.
_EVAL_CHUNK_ELEMENTS = 1 << 22


class Pattern:
    """Base class of attention patterns: which keys each query position may see.

    Subclasses are frozen dataclasses (hashable, so layouts are cached per pattern and shape)
    and implement :meth:`mask`. They may override :meth:`block_kinds` with a closed form, which
    keeps layout construction cheap at long lengths; the generic one scans the mask in chunks.

    Attributes:
      causal_safe: True when no query sees a later key (such a pattern can decode).
      encoder_only: True when the pattern connects queries to later keys by construction
        (relay nodes, block permutations, span trees, random blocks), so asking for
        ``causal=True`` with it raises instead of silently dropping half of its structure.
      offsets_only: True when ``mask(i, j)`` depends on ``i - j`` alone (bands, strides,
        dilations): a document packed at any offset of a row then sees, inside the segment
        mask, the pattern it sees alone; patterns of absolute positions (global tokens, blocks
        from the row's start, random blocks) do not.
    """

    causal_safe: ClassVar[bool] = False
    encoder_only: ClassVar[bool] = False
    offsets_only: ClassVar[bool] = False

    def mask(self, i: np.ndarray, j: np.ndarray, lq: int, lk: int) -> np.ndarray:
        """Elementwise connectivity for broadcastable int64 query positions ``i``, key ``j``.

        ``lq`` and ``lk`` are the full lengths (some patterns depend on them).
        """
        raise NotImplementedError

    # -- derived -------------------------------------------------------------------------------

    def dense(self, lq: int, lk: int) -> np.ndarray:
        """The ``bool[lq, lk]`` connectivity matrix (references, tests, pictures)."""
        i = np.arange(lq, dtype=np.int64)[:, None]
        j = np.arange(lk, dtype=np.int64)[None, :]
        return np.broadcast_to(self.mask(i, j, lq, lk), (lq, lk)).copy()

    @staticmethod
    def tile_bounds(lq: int, lk: int, block_q: int, block_k: int):
        """For closed-form :meth:`block_kinds`: the first and last real query row ``[nq, 1]``
        and key column ``[1, nk]`` of every ``block_q x block_k`` tile, ``(r0, r1, c0, c1)``."""
        nq, nk = cdiv(lq, block_q), cdiv(lk, block_k)
        r0 = np.arange(nq, dtype=np.int64)[:, None] * block_q
        r1 = np.minimum(r0 + block_q, lq) - 1
        c0 = np.arange(nk, dtype=np.int64)[None, :] * block_k
        c1 = np.minimum(c0 + block_k, lk) - 1
        return r0, r1, c0, c1

    @staticmethod
    def tile_kinds(full: np.ndarray, empty: np.ndarray) -> np.ndarray:
        """For closed-form :meth:`block_kinds`: ``int8`` tile kinds from where every pair of a
        tile is kept (``full``) and where none is (``empty``); PARTIAL elsewhere."""
        return np.where(full, FULL, np.where(empty, EMPTY, PARTIAL)).astype(np.int8)

    def block_kinds(self, lq: int, lk: int, block_q: int, block_k: int) -> np.ndarray:
        """``int8[nq, nk]``: which tiles are empty (0), partial (1) or full (2).

        A tile is judged only on the real positions it covers (``< lq``, ``< lk``). Overrides
        may answer PARTIAL conservatively; :meth:`layout` re-checks partial tiles exactly.
        """
        nq, nk = cdiv(lq, block_q), cdiv(lk, block_k)
        kinds = np.empty((nq, nk), np.int8)
        j = np.arange(lk, dtype=np.int64)[None, :]
        rows = max(block_q, (_EVAL_CHUNK_ELEMENTS // max(lk, 1)) // block_q * block_q)
        for start in range(0, lq, rows):
            stop = min(lq, start + rows)
            i = np.arange(start, stop, dtype=np.int64)[:, None]
            m = np.broadcast_to(self.mask(i, j, lq, lk), (stop - start, lk))
            pad_q, pad_k = cdiv(stop - start, block_q) * block_q, nk * block_k
            valid = np.zeros((pad_q, pad_k), bool)
            valid[: stop - start, :lk] = True
            full = np.zeros((pad_q, pad_k), bool)
            full[: stop - start, :lk] = m
            tiles = full.reshape(pad_q // block_q, block_q, nk, block_k)
            valid_t = valid.reshape(pad_q // block_q, block_q, nk, block_k)
            any_ = tiles.any(axis=(1, 3))
            all_ = (tiles | ~valid_t).all(axis=(1, 3))
            b0 = start // block_q
            kinds[b0 : b0 + any_.shape[0]] = np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY))
        return kinds

    def layout(self, lq: int, lk: int, block_q: int, block_k: int) -> BlockLayout:
        """The :class:`BlockLayout` of this pattern for the given lengths and tiles (cached)."""
        for name, value in (("lq", lq), ("lk", lk), ("block_q", block_q), ("block_k", block_k)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(
                    f"{type(self).__name__}.layout: {name} must be a positive integer, got "
                    f"{value!r}"
                )
        return _layout(self, int(lq), int(lk), int(block_q), int(block_k))

    def __or__(self, other: "Pattern") -> "Pattern":
        return Union((self, other))

    def __and__(self, other: "Pattern") -> "Pattern":
        return Intersection((self, other))


@functools.lru_cache(maxsize=256)
def _layout(pattern: Pattern, lq: int, lk: int, block_q: int, block_k: int) -> BlockLayout:
    kinds = np.asarray(pattern.block_kinds(lq, lk, block_q, block_k), np.int8).copy()
    nq, nk = kinds.shape
    if (nq, nk) != (cdiv(lq, block_q), cdiv(lk, block_k)):
        raise AssertionError(f"{pattern!r}.block_kinds returned shape {kinds.shape}")
    if lk % block_k:
        # The last key tile holds padding, so it can never be free of an in-tile mask.
        kinds[:, -1] = np.where(kinds[:, -1] == FULL, PARTIAL, kinds[:, -1])
    mask_index = np.full((nq, nk), -1, np.int32)
    unique: dict[bytes, int] = {}
    masks = []
    for bi, bj in zip(*np.nonzero(kinds == PARTIAL)):
        i = np.arange(bi * block_q, (bi + 1) * block_q, dtype=np.int64)[:, None]
        j = np.arange(bj * block_k, (bj + 1) * block_k, dtype=np.int64)[None, :]
        m = np.broadcast_to(pattern.mask(i, j, lq, lk), (block_q, block_k)) & (j < lk)
        real = m[: max(0, min(block_q, lq - bi * block_q))]
        if not real.any():
            kinds[bi, bj] = EMPTY
            continue
        if real.all() and j[0, -1] < lk:
            kinds[bi, bj] = FULL
            continue
        m = np.ascontiguousarray(m)
        idx = unique.setdefault(m.tobytes(), len(masks))
        if idx == len(masks):
            masks.append(m)
        mask_index[bi, bj] = idx
    partial = np.stack(masks) if masks else np.zeros((0, block_q, block_k), bool)
    for arr in (kinds, mask_index, partial):
        arr.setflags(write=False)
    return BlockLayout(lq, lk, block_q, block_k, kinds, mask_index, partial)


@dataclasses.dataclass(frozen=True)
class Union(Pattern):
    """Keys visible under any of ``parts`` (``a | b``)."""

    parts: tuple[Pattern, ...]

    def __post_init__(self):
        flat = []
        for p in self.parts:
            if not isinstance(p, Pattern):
                raise TypeError(f"Union: {p!r} is not a Pattern")
            flat.extend(p.parts if isinstance(p, Union) else (p,))
        object.__setattr__(self, "parts", tuple(flat))

    @property
    def causal_safe(self) -> bool:  # type: ignore[override]
        return all(p.causal_safe for p in self.parts)

    @property
    def encoder_only(self) -> bool:  # type: ignore[override]
        return any(p.encoder_only for p in self.parts)

    @property
    def offsets_only(self) -> bool:  # type: ignore[override]
        return all(p.offsets_only for p in self.parts)

    def mask(self, i, j, lq, lk):
        return functools.reduce(np.logical_or, (p.mask(i, j, lq, lk) for p in self.parts))

    def block_kinds(self, lq, lk, block_q, block_k):
        kinds = [p.block_kinds(lq, lk, block_q, block_k) for p in self.parts]
        any_full = functools.reduce(np.logical_or, (k == FULL for k in kinds))
        any_nonempty = functools.reduce(np.logical_or, (k != EMPTY for k in kinds))
        return np.where(any_full, FULL, np.where(any_nonempty, PARTIAL, EMPTY)).astype(np.int8)


@dataclasses.dataclass(frozen=True)
class Intersection(Pattern):
    """Keys visible under all of ``parts`` (``a & b``)."""

    parts: tuple[Pattern, ...]

    def __post_init__(self):
        flat = []
        for p in self.parts:
            if not isinstance(p, Pattern):
                raise TypeError(f"Intersection: {p!r} is not a Pattern")
            flat.extend(p.parts if isinstance(p, Intersection) else (p,))
        object.__setattr__(self, "parts", tuple(flat))

    @property
    def causal_safe(self) -> bool:  # type: ignore[override]
        return any(p.causal_safe for p in self.parts)

    @property
    def encoder_only(self) -> bool:  # type: ignore[override]
        # Any encoder-only part makes it encoder only: intersecting with Causal would still cut
        # that part's connections to later keys.
        return any(p.encoder_only for p in self.parts)

    @property
    def offsets_only(self) -> bool:  # type: ignore[override]
        return all(p.offsets_only for p in self.parts)

    def mask(self, i, j, lq, lk):
        return functools.reduce(np.logical_and, (p.mask(i, j, lq, lk) for p in self.parts))

    def block_kinds(self, lq, lk, block_q, block_k):
        kinds = [p.block_kinds(lq, lk, block_q, block_k) for p in self.parts]
        all_full = functools.reduce(np.logical_and, (k == FULL for k in kinds))
        any_empty = functools.reduce(np.logical_or, (k == EMPTY for k in kinds))
        return np.where(any_empty, EMPTY, np.where(all_full, FULL, PARTIAL)).astype(np.int8)
