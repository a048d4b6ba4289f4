"""The basic patterns: full, causal, local band, static key padding and static packing."""

from __future__ import annotations

import dataclasses

import numpy as np

from ._base import FULL, Pattern, cdiv



@dataclasses.dataclass(frozen=True)
class Full(Pattern):
    """Every query sees every key (dense attention)."""

    offsets_only = True

    def mask(self, i, j, lq, lk):
        return np.ones(np.broadcast_shapes(np.shape(i), np.shape(j)), bool)

    def block_kinds(self, lq, lk, block_q, block_k):
        return np.full((cdiv(lq, block_q), cdiv(lk, block_k)), FULL, np.int8)


@dataclasses.dataclass(frozen=True)
class Causal(Pattern):
    """Query i sees keys ``j <= i`` (positions counted from the start of both sequences)."""

    causal_safe = True
    offsets_only = True

    def mask(self, i, j, lq, lk):
        return j <= i

    def block_kinds(self, lq, lk, block_q, block_k):
        r0, r1, c0, c1 = Pattern.tile_bounds(lq, lk, block_q, block_k)
        return Pattern.tile_kinds(c1 <= r0, c0 > r1)


@dataclasses.dataclass(frozen=True)
class Local(Pattern):
    """A band: query i sees keys ``i - left <= j <= i + right`` (Longformer's sliding window).

    ``Local(w, 0)`` is the causal sliding window of width ``w + 1``.
    """

    offsets_only = True
    left: int
    right: int

    def __post_init__(self):
        for name in ("left", "right"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"Local: {name} must be a non-negative integer, got {value!r}")

    @property
    def causal_safe(self) -> bool:  # type: ignore[override]
        return self.right == 0

    def mask(self, i, j, lq, lk):
        return (j >= i - self.left) & (j <= i + self.right)

    def block_kinds(self, lq, lk, block_q, block_k):
        r0, r1, c0, c1 = Pattern.tile_bounds(lq, lk, block_q, block_k)
        full = (c0 >= r1 - self.left) & (c1 <= r0 + self.right)
        empty = (c1 < r0 - self.left) | (c0 > r1 + self.right)
        return Pattern.tile_kinds(full, empty)


@dataclasses.dataclass(frozen=True)
class KeyPadding(Pattern):
    """Only the first ``length`` keys are real: a key padding mask whose length is static.

    When the amount of padding is data (differs per example), pass ``kv_mask`` instead; this
    static form lets kernels skip the padded key tiles outright.
    """

    length: int

    def __post_init__(self):
        if isinstance(self.length, bool) or not isinstance(self.length, (int, np.integer)) or self.length < 0:
            raise ValueError(f"KeyPadding: length must be a non-negative integer, got {self.length!r}")

    def mask(self, i, j, lq, lk):
        return np.broadcast_to(j < self.length, np.broadcast_shapes(np.shape(i), np.shape(j)))

    def block_kinds(self, lq, lk, block_q, block_k):
        r0, r1, c0, c1 = Pattern.tile_bounds(lq, lk, block_q, block_k)
        full = np.broadcast_to(c1 < self.length, (r0.shape[0], c0.shape[1]))
        empty = np.broadcast_to(c0 >= self.length, full.shape)
        return Pattern.tile_kinds(full, empty)


@dataclasses.dataclass(frozen=True)
class Segments(Pattern):
    """Packed sequences whose lengths are static: query i sees key j in the same segment.

    ``lengths`` lists consecutive segment lengths for the queries; ``kv_lengths`` for the keys
    (default: the same, i.e. self-attention). Positions past the last segment belong to none and
    see nothing. For segment ids that are data, pass ``segment_ids`` to the kernel instead.
    """

    lengths: tuple[int, ...]
    kv_lengths: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        if self.kv_lengths is not None:
            object.__setattr__(self, "kv_lengths", tuple(int(n) for n in self.kv_lengths))
            if len(self.kv_lengths) != len(self.lengths):
                raise ValueError(
                    f"Segments: {len(self.lengths)} query segments but {len(self.kv_lengths)} "
                    "key segments"
                )
        if any(n <= 0 for n in self.lengths + (self.kv_lengths or ())):
            raise ValueError(f"Segments: lengths must be positive, got {self}")

    @staticmethod
    def _ids(positions, lengths):
        bounds = np.cumsum(lengths)
        ids = np.searchsorted(bounds, positions, side="right")
        return np.where(ids < len(lengths), ids, -1)

    def mask(self, i, j, lq, lk):
        qi = self._ids(i, self.lengths)
        kj = self._ids(j, self.kv_lengths or self.lengths)
        return (qi == kj) & (qi >= 0)

    def block_kinds(self, lq, lk, block_q, block_k):
        r0, r1, c0, c1 = Pattern.tile_bounds(lq, lk, block_q, block_k)
        kv = self.kv_lengths or self.lengths
        q_first, q_last = self._ids(r0, self.lengths), self._ids(r1, self.lengths)
        k_first, k_last = self._ids(c0, kv), self._ids(c1, kv)
        # -1 (past the end) sorts after every segment.
        big = len(self.lengths)
        q_last_s = np.where(q_last < 0, big, q_last)
        k_last_s = np.where(k_last < 0, big, k_last)
        q_first_s = np.where(q_first < 0, big, q_first)
        k_first_s = np.where(k_first < 0, big, k_first)
        full = (q_first == q_last) & (k_first == k_last) & (q_first == k_first) & (q_first >= 0)
        overlap_hi = np.minimum(q_last_s, np.minimum(k_last_s, big - 1))
        empty = np.maximum(q_first_s, k_first_s) > overlap_hi
        return Pattern.tile_kinds(full, empty)
