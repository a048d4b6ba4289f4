"""Masks as data: the pattern protocol and the block layout every exact kernel consumes.

A :class:`Pattern` is a small, hashable, numpy-side description of which keys each query may
see. It is never materialised at full size on the device. Kernels ask it for a
:class:`BlockLayout`: for a tiling of the ``[Lq, Lk]`` score matrix into ``block_q x block_k``
tiles, which tiles are empty (skipped), full (no in-block mask) or partial (masked in-block
with one of a de-duplicated set of tile masks). The XLA block-sparse path and the Pallas
kernels read the same layout (JAX's splash attention calls the equivalent ``MaskInfo``).

Patterns compose with ``|`` (union) and ``&`` (intersection).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2

# Host-side evaluation of a generic pattern visits the mask in query-row chunks of about this
# many elements, so building a layout never holds the whole L x L matrix.
_EVAL_CHUNK_ELEMENTS = 1 << 22


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockLayout:
    """The block structure of a pattern for one tiling, computed once on the host.

    Attributes:
      lq, lk: the true sequence lengths (the grid covers them rounded up to whole blocks; keys
        past ``lk`` are masked, queries past ``lq`` are ignored).
      block_q, block_k: tile sizes.
      kinds: ``int8[nq, nk]``: 0 empty, 1 partial, 2 full.
      mask_index: ``int32[nq, nk]``: for partial tiles, the index of their mask in
        ``partial_masks``; -1 elsewhere.
      partial_masks: ``bool[n_unique, block_q, block_k]``: the distinct in-tile masks.
    """

    lq: int
    lk: int
    block_q: int
    block_k: int
    kinds: np.ndarray
    mask_index: np.ndarray
    partial_masks: np.ndarray

    @property
    def num_q_blocks(self) -> int:
        return self.kinds.shape[0]

    @property
    def num_k_blocks(self) -> int:
        return self.kinds.shape[1]

    @property
    def num_nonempty(self) -> int:
        return int(np.count_nonzero(self.kinds))

    @property
    def density(self) -> float:
        """Fraction of tiles that are computed (partial or full)."""
        return self.num_nonempty / self.kinds.size

    @functools.cached_property
    def pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The non-empty tiles in row-major order: ``(q_block, k_block, mask_index)``.

        ``mask_index`` is -1 for full tiles. This is the compacted work list the XLA path scans.
        """
        qb, kb = np.nonzero(self.kinds)
        return (
            qb.astype(np.int32),
            kb.astype(np.int32),
            self.mask_index[qb, kb].astype(np.int32),
        )

    @functools.cached_property
    def row_counts(self) -> np.ndarray:
        """``int32[nq]``: the number of non-empty key tiles of each query tile."""
        return np.count_nonzero(self.kinds, axis=1).astype(np.int32)

    def dense(self) -> np.ndarray:
        """The ``bool[lq, lk]`` connectivity this layout encodes (for tests)."""
        nq, nk = self.kinds.shape
        bq, bk = self.block_q, self.block_k
        out = np.zeros((nq * bq, nk * bk), bool)
        for i, j in zip(*np.nonzero(self.kinds)):
            tile = (
                True
                if self.kinds[i, j] == FULL
                else self.partial_masks[self.mask_index[i, j]]
            )
            out[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk] = tile
        return out[: self.lq, : self.lk]

    def __repr__(self) -> str:
        return (
            f"BlockLayout(lq={self.lq}, lk={self.lk}, block_q={self.block_q}, "
            f"block_k={self.block_k}, tiles={self.kinds.shape}, nonempty={self.num_nonempty}, "
            f"unique_partial_masks={len(self.partial_masks)})"
        )


class Pattern:
    """Base class of attention patterns: which keys each query position may see.

    Subclasses are frozen dataclasses (hashable, so layouts are cached per pattern and shape)
    and implement :meth:`mask`. They may override :meth:`block_kinds` with a closed form, which
    keeps layout construction cheap at long lengths; the generic one scans the mask in chunks.

    Attributes:
      causal_safe: True when no query sees a later key (such a pattern can decode).
    """

    causal_safe: ClassVar[bool] = False

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

    def block_kinds(self, lq: int, lk: int, block_q: int, block_k: int) -> np.ndarray:
        """``int8[nq, nk]``: which tiles are empty (0), partial (1) or full (2).

        A tile is judged only on the real positions it covers (``< lq``, ``< lk``). Overrides
        may answer PARTIAL conservatively; :meth:`layout` re-checks partial tiles exactly.
        """
        nq, nk = _cdiv(lq, block_q), _cdiv(lk, block_k)
        kinds = np.empty((nq, nk), np.int8)
        j = np.arange(lk, dtype=np.int64)[None, :]
        rows = max(block_q, (_EVAL_CHUNK_ELEMENTS // max(lk, 1)) // block_q * block_q)
        for start in range(0, lq, rows):
            stop = min(lq, start + rows)
            i = np.arange(start, stop, dtype=np.int64)[:, None]
            m = np.broadcast_to(self.mask(i, j, lq, lk), (stop - start, lk))
            pad_q, pad_k = _cdiv(stop - start, block_q) * block_q, nk * block_k
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
    if (nq, nk) != (_cdiv(lq, block_q), _cdiv(lk, block_k)):
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

    def mask(self, i, j, lq, lk):
        return functools.reduce(np.logical_and, (p.mask(i, j, lq, lk) for p in self.parts))

    def block_kinds(self, lq, lk, block_q, block_k):
        kinds = [p.block_kinds(lq, lk, block_q, block_k) for p in self.parts]
        all_full = functools.reduce(np.logical_and, (k == FULL for k in kinds))
        any_empty = functools.reduce(np.logical_or, (k == EMPTY for k in kinds))
        return np.where(any_empty, EMPTY, np.where(all_full, FULL, PARTIAL)).astype(np.int8)
