"""The block layout every exact kernel consumes: which tiles of a score matrix are computed.

For a tiling of the ``[Lq, Lk]`` score matrix into ``block_q x block_k`` tiles, a
:class:`BlockLayout` says which tiles are empty (skipped), full (no in-tile mask) or partial
(masked in-tile with one of a de-duplicated set of tile masks). Patterns
(``xformers_jax.attention.patterns``) produce layouts; the XLA tiled back end (``_tiled``), the
planner and the Pallas kernels read them (JAX's splash attention calls the equivalent
``MaskInfo``).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2


def cdiv(a: int, b: int) -> int:
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
