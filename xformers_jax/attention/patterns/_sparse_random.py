"""Seeded random patterns: random attention (a few random keys per query, the random part of
BigBird) and BigBird itself (Zaheer et al., 2020).

The random connections are fixed per layer: they are drawn once on the host from
``numpy.random.default_rng(seed)`` for the given lengths, so the same seed gives the same
pattern and different seeds (e.g. one per layer) give different ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import numpy as np

from ._base import Pattern, cdiv
from ._sparse import _check_int, block_matrix_kinds, block_matrix_mask


def _choose(rng: np.random.Generator, candidates: np.ndarray, r: int) -> np.ndarray:
    return candidates if len(candidates) <= r else rng.choice(candidates, r, replace=False)


@functools.lru_cache(maxsize=64)
def _random_keys(seed: int, r: int, lq: int, lk: int) -> np.ndarray:
    """``int64[lq, min(r, lk)]``: distinct random keys of each query."""
    rng = np.random.default_rng(seed)
    r = min(r, lk)
    return np.stack([rng.choice(lk, r, replace=False) for _ in range(lq)])


@dataclasses.dataclass(frozen=True)
class Random(Pattern):
    """Random attention: each query sees ``num_keys`` random keys (``block=None``), or each
    query block of ``block`` positions sees ``num_keys`` random key blocks of the same size.

    Under ``causal=True`` the connections to later keys are dropped (``& Causal()``).
    """

    num_keys: int
    seed: int = 0
    block: int | None = None

    def __post_init__(self):
        _check_int("Random", "num_keys", self.num_keys, 0)
        _check_int("Random", "seed", self.seed, 0)
        if self.block is not None:
            _check_int("Random", "block", self.block, 1)

    def _blocks(self, lq, lk) -> np.ndarray:
        nbq, nbk = cdiv(lq, self.block), cdiv(lk, self.block)
        keys = _random_keys(self.seed, self.num_keys, nbq, nbk)
        out = np.zeros((nbq, nbk), bool)
        out[np.arange(nbq)[:, None], keys] = True
        return out

    def mask(self, i, j, lq, lk):
        if self.block is not None:
            return block_matrix_mask(self._blocks(lq, lk), self.block, i, j, lq, lk)
        keys = _random_keys(self.seed, self.num_keys, lq, lk)
        hit = (keys[np.clip(i, 0, lq - 1)] == np.asarray(j)[..., None]).any(-1)
        return hit & (i >= 0) & (i < lq)

    def block_kinds(self, lq, lk, block_q, block_k):
        if self.block is not None:
            return block_matrix_kinds(self._blocks(lq, lk), self.block, lq, lk, block_q, block_k)
        r0, _, c0, _ = Pattern.tile_bounds(lq, lk, block_q, block_k)
        kinds = np.zeros((r0.shape[0], c0.shape[1]), np.int8)
        keys = _random_keys(self.seed, self.num_keys, lq, lk)
        rows = np.broadcast_to(np.arange(lq)[:, None] // block_q, keys.shape)
        kinds[rows, keys // block_k] = 1  # PARTIAL; layout() promotes tiles that are all hits
        return kinds


@dataclasses.dataclass(frozen=True)
class BigBird(Pattern):
    """BigBird-ITC at block granularity (Zaheer et al., 2020).

    The sequence is cut into blocks of ``block`` positions. Query block ``b`` sees the
    ``num_window_blocks`` blocks centred on it, the global blocks (the first
    ``num_global_blocks - num_global_blocks // 2`` and the last ``num_global_blocks // 2``
    blocks, as in the paper's implementation: first and last for 2), and
    ``num_random_blocks`` random blocks drawn (seeded) from the rest; global query blocks see
    everything. Encoder only (the global and random parts see the future).
    """

    block: int
    num_window_blocks: int = 3
    num_global_blocks: int = 2
    num_random_blocks: int = 3
    seed: int = 0

    encoder_only: ClassVar[bool] = True

    def __post_init__(self):
        _check_int("BigBird", "block", self.block, 1)
        _check_int("BigBird", "num_window_blocks", self.num_window_blocks, 1)
        if self.num_window_blocks % 2 == 0:
            raise ValueError(f"BigBird: num_window_blocks must be odd, got {self.num_window_blocks}")
        _check_int("BigBird", "num_global_blocks", self.num_global_blocks, 0)
        _check_int("BigBird", "num_random_blocks", self.num_random_blocks, 0)
        _check_int("BigBird", "seed", self.seed, 0)

    def global_blocks(self, num_blocks: int) -> np.ndarray:
        g = self.num_global_blocks
        first = np.arange(min(g - g // 2, num_blocks))
        last = np.arange(max(0, num_blocks - g // 2), num_blocks)
        return np.union1d(first, last)

    def blocks(self, lq: int, lk: int) -> np.ndarray:
        """``bool[ceil(lq / block), ceil(lk / block)]``: the pattern at block granularity."""
        return _bigbird_blocks(self, lq, lk)

    def mask(self, i, j, lq, lk):
        return block_matrix_mask(self.blocks(lq, lk), self.block, i, j, lq, lk)

    def block_kinds(self, lq, lk, block_q, block_k):
        return block_matrix_kinds(self.blocks(lq, lk), self.block, lq, lk, block_q, block_k)


@functools.lru_cache(maxsize=64)
def _bigbird_blocks(p: BigBird, lq: int, lk: int) -> np.ndarray:
    nbq, nbk = cdiv(lq, p.block), cdiv(lk, p.block)
    half = p.num_window_blocks // 2
    qb, kb = np.arange(nbq)[:, None], np.arange(nbk)[None, :]
    out = np.abs(qb - kb) <= half
    g_k = p.global_blocks(nbk)
    out[:, g_k] = True
    g_q = p.global_blocks(nbq)
    out[g_q, :] = True
    rng = np.random.default_rng(p.seed)
    for b in range(nbq):
        if b in g_q:
            continue
        candidates = np.flatnonzero(~out[b])
        out[b, _choose(rng, candidates, p.num_random_blocks)] = True
    out.setflags(write=False)
    return out
