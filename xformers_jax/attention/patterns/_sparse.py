"""Fixed sparse patterns: atomic (dilated, strided, global, block-local) and
compound (Star, Sparse Transformer, Cascade, LogSparse, BlockBERT, Longformer, Image
Transformer, BP-Transformer), plus per-head assignment.

Index formulas are those of the original papers cited on each pattern, in the bidirectional
form given by Fournier et al. (2021, "A Practical Survey on Faster and Lighter Transformers",
Figs 10-15, Eq. 14); the atomic patterns are those of Lin et al. (2022, "A Survey of
Transformers", Figs 4-6). Patterns marked ``encoder_only`` connect every query
to later keys by construction (relay nodes, block permutations, span trees); asking for
``causal=True`` with them raises instead of silently dropping half of their structure.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import numpy as np

from ._base import Pattern, cdiv
from ._basic import Local


def _check_int(cls: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{cls}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _interval_kinds(lo, hi, lq, lk, block_q, block_k, exact=True):
    """Tile kinds when row i sees the key interval ``[lo(i), hi(i)]``, both non-decreasing in i.

    With ``exact=False`` the interval is only a hull (e.g. a dilated band): no tile is FULL.
    """
    r0, r1, c0, c1 = Pattern.tile_bounds(lq, lk, block_q, block_k)
    empty = (hi(r1) < c0) | (lo(r0) > c1)
    full = (lo(r1) <= c0) & (hi(r0) >= c1) if exact else np.zeros_like(empty)
    return Pattern.tile_kinds(full, empty)


def _count_in(sorted_positions: np.ndarray, a, b):
    """How many of ``sorted_positions`` lie in ``[a, b]`` (elementwise over arrays a, b)."""
    return np.searchsorted(sorted_positions, b, side="right") - np.searchsorted(
        sorted_positions, a, side="left"
    )


def block_matrix_kinds(blocks: np.ndarray, block: int, lq, lk, block_q, block_k):
    """Tile kinds of a pattern given at block granularity (``blocks[qb, kb]``, size ``block``).

    Any tiling works: a 2-D prefix sum counts the pattern blocks each tile touches.
    """
    r0, r1, c0, c1 = Pattern.tile_bounds(lq, lk, block_q, block_k)
    pr0, pr1, pc0, pc1 = r0 // block, r1 // block, c0 // block, c1 // block
    s = np.zeros((blocks.shape[0] + 1, blocks.shape[1] + 1), np.int64)
    s[1:, 1:] = np.cumsum(np.cumsum(blocks, axis=0), axis=1)
    count = s[pr1 + 1, pc1 + 1] - s[pr0, pc1 + 1] - s[pr1 + 1, pc0] + s[pr0, pc0]
    return Pattern.tile_kinds(count == (pr1 - pr0 + 1) * (pc1 - pc0 + 1), count == 0)


def block_matrix_mask(blocks: np.ndarray, block: int, i, j, lq, lk):
    """Elementwise mask of a pattern given at block granularity; False outside the lengths."""
    valid = (i >= 0) & (i < lq) & (j >= 0) & (j < lk)
    qb = np.clip(i // block, 0, blocks.shape[0] - 1)
    kb = np.clip(j // block, 0, blocks.shape[1] - 1)
    return blocks[qb, kb] & valid


@dataclasses.dataclass(frozen=True)
class Dilated(Pattern):
    """Dilated window (Beltagy et al., 2020, Longformer): ``j = i + t * dilation`` for
    ``-left <= t <= right``.

    ``left`` and ``right`` count attended keys on each side (the receptive field is
    ``dilation`` times wider than a band with as many keys); ``dilation=1`` is ``Local``.
    """

    offsets_only = True

    left: int
    right: int
    dilation: int = 1

    def __post_init__(self):
        _check_int("Dilated", "left", self.left, 0)
        _check_int("Dilated", "right", self.right, 0)
        _check_int("Dilated", "dilation", self.dilation, 1)

    @property
    def causal_safe(self) -> bool:  # type: ignore[override]
        return self.right == 0

    def mask(self, i, j, lq, lk):
        d = self.dilation
        return (j >= i - self.left * d) & (j <= i + self.right * d) & ((j - i) % d == 0)

    def block_kinds(self, lq, lk, block_q, block_k):
        d = self.dilation
        return _interval_kinds(
            lambda r: r - self.left * d, lambda r: r + self.right * d,
            lq, lk, block_q, block_k, exact=d == 1,
        )


def _strided_kinds(stride, lq, lk, block_q, block_k):
    """Tiles holding some (i, j) with ``(i - j) mod stride == 0``."""
    r0, r1, c0, c1 = Pattern.tile_bounds(lq, lk, block_q, block_k)
    lo, hi = r0 - c1, r1 - c0  # every difference in [lo, hi] occurs in the tile
    nonempty = (hi // stride) * stride >= lo
    return Pattern.tile_kinds(np.broadcast_to(stride == 1, nonempty.shape), ~nonempty)


@dataclasses.dataclass(frozen=True)
class Strided(Pattern):
    """Sparse Transformer strided attention (Child et al., 2019, Fig. 3b).

    ``i`` sees ``j`` if ``(i + s) > j > (i - s)`` (the local part) or ``(i - j) mod s == 0``
    (the strided part); the stride ``s`` is chosen close to ``sqrt(n)``. ``part`` selects one
    half for the factorised form where half the heads take each (:meth:`PerHead.sparse_transformer`).
    Causal decoding (the original model) is this pattern ``& Causal()``.
    """

    offsets_only = True

    stride: int
    part: str = "both"

    def __post_init__(self):
        _check_int("Strided", "stride", self.stride, 1)
        if self.part not in ("both", "local", "strided"):
            raise ValueError(f"Strided: part must be 'both', 'local' or 'strided', got {self.part!r}")

    def mask(self, i, j, lq, lk):
        s = self.stride
        local = (j < i + s) & (j > i - s)
        strided = (i - j) % s == 0
        return {"both": local | strided, "local": local, "strided": strided}[self.part]

    def block_kinds(self, lq, lk, block_q, block_k):
        local = Local(self.stride - 1, self.stride - 1).block_kinds(lq, lk, block_q, block_k)
        strided = _strided_kinds(self.stride, lq, lk, block_q, block_k)
        if self.part == "local":
            return local
        if self.part == "strided":
            return strided
        return np.maximum(local, strided)  # EMPTY < PARTIAL < FULL: the union's kind


@dataclasses.dataclass(frozen=True)
class BlockLocal(Pattern):
    """Block-local attention (Parmar et al., 2018; the local heads of Child et al., 2019):
    ``i // b == j // b``."""

    block: int

    def __post_init__(self):
        _check_int("BlockLocal", "block", self.block, 1)

    def mask(self, i, j, lq, lk):
        return i // self.block == j // self.block

    def block_kinds(self, lq, lk, block_q, block_k):
        b = self.block
        return _interval_kinds(lambda r: r // b * b, lambda r: r // b * b + b - 1,
                               lq, lk, block_q, block_k)


@dataclasses.dataclass(frozen=True)
class Fixed(Pattern):
    """Sparse Transformer fixed attention (Child et al., 2019, Fig. 3c).

    ``i`` sees ``j`` if ``floor(j / s) == floor(i / s)`` (``part="block"``) or
    ``(j mod s) >= s - c`` (``part="summary"``: the last ``c`` positions of every block act as
    summaries). ``part="both"`` is their union.
    """

    stride: int
    c: int = 1
    part: str = "both"

    def __post_init__(self):
        _check_int("Fixed", "stride", self.stride, 1)
        _check_int("Fixed", "c", self.c, 1)
        if self.c > self.stride:
            raise ValueError(f"Fixed: c={self.c} must not exceed stride={self.stride}")
        if self.part not in ("both", "block", "summary"):
            raise ValueError(f"Fixed: part must be 'both', 'block' or 'summary', got {self.part!r}")

    def mask(self, i, j, lq, lk):
        s = self.stride
        block = (j // s) == (i // s)
        summary = np.broadcast_to(j % s >= s - self.c, np.broadcast_shapes(np.shape(i), np.shape(j)))
        return {"both": block | summary, "block": block, "summary": summary}[self.part]

    def _summary_kinds(self, lq, lk, block_q, block_k):
        s, c = self.stride, self.c
        r0, r1, c0, c1 = Pattern.tile_bounds(lq, lk, block_q, block_k)

        def below(x):  # summary columns in [0, x)
            return (x // s) * c + np.maximum(0, x % s - (s - c))

        count = np.broadcast_to(below(c1 + 1) - below(c0), (r0.shape[0], c0.shape[1]))
        return Pattern.tile_kinds(count == (c1 - c0 + 1), count == 0)

    def block_kinds(self, lq, lk, block_q, block_k):
        block = BlockLocal(self.stride).block_kinds(lq, lk, block_q, block_k)
        summary = self._summary_kinds(lq, lk, block_q, block_k)
        return {"both": np.maximum(block, summary), "block": block, "summary": summary}[self.part]


@dataclasses.dataclass(frozen=True)
class Global(Pattern):
    """Internal global tokens (Beltagy et al., 2020; Zaheer et al., 2020): positions in
    ``tokens`` see every key and are seen by every query. Under ``causal=True`` they keep only
    what decoding allows."""

    tokens: tuple[int, ...]

    def __post_init__(self):
        tokens = tuple(sorted({_check_int("Global", "token", t, 0) for t in self.tokens}))
        object.__setattr__(self, "tokens", tokens)

    def mask(self, i, j, lq, lk):
        g = np.asarray(self.tokens, np.int64)
        return np.isin(i, g) | np.isin(j, g)

    def block_kinds(self, lq, lk, block_q, block_k):
        g = np.asarray(self.tokens, np.int64)
        r0, r1, c0, c1 = Pattern.tile_bounds(lq, lk, block_q, block_k)
        rows, cols = _count_in(g, r0, r1), _count_in(g, c0, c1)
        full = (rows == r1 - r0 + 1) | (cols == c1 - c0 + 1)
        return Pattern.tile_kinds(full, (rows == 0) & (cols == 0))


@dataclasses.dataclass(frozen=True)
class Star(Pattern):
    """Star-Transformer (Guo et al., 2019): a relay node at position 0 sees and is seen by all;
    every other ``i`` sees ``j = 0`` and ``i - 1 <= j <= i + 1``. Encoder only."""

    encoder_only: ClassVar[bool] = True

    @functools.cached_property
    def _union(self) -> Pattern:
        return Local(1, 1) | Global((0,))

    def mask(self, i, j, lq, lk):
        return self._union.mask(i, j, lq, lk)

    def block_kinds(self, lq, lk, block_q, block_k):
        return self._union.block_kinds(lq, lk, block_q, block_k)


@dataclasses.dataclass(frozen=True)
class Cascade(Pattern):
    """Cascade Transformer (Wang et al., 2020, "Transformer on a Diet"): a band of
    ``2 * b * m**layer - 1`` connections at layer ``layer`` (0-based), base window ``b``,
    cardinal number ``m``; causal via ``& Causal()``."""

    base: int
    cardinal: int
    layer: int

    def __post_init__(self):
        _check_int("Cascade", "base", self.base, 1)
        _check_int("Cascade", "cardinal", self.cardinal, 1)
        _check_int("Cascade", "layer", self.layer, 0)

    @property
    def connections(self) -> int:
        return 2 * self.base * self.cardinal**self.layer - 1

    @property
    def _band(self) -> Local:
        half = (self.connections - 1) // 2
        return Local(half, half)

    def mask(self, i, j, lq, lk):
        return self._band.mask(i, j, lq, lk)

    def block_kinds(self, lq, lk, block_q, block_k):
        return self._band.block_kinds(lq, lk, block_q, block_k)


def _is_power_of_two(d):
    return (d > 0) & ((d & (d - 1)) == 0)


@dataclasses.dataclass(frozen=True)
class LogSparse(Pattern):
    """LogSparse Transformer (Li et al., 2019): ``i`` sees ``i`` and ``i +- 2**k`` (k >= 0), so
    O(log n) keys per query. The two alternatives of the paper:

    - ``local=k``: every key within distance ``k`` is seen, after which the exponential steps
      resume from there (distances ``k + 2**t``);
    - ``subsequence=s``: the sequence is cut into subsequences of length ``s`` and LogSparse
      runs within each.

    The forecasting model is causal: use ``& Causal()`` (or ``causal=True``).
    """

    local: int = 0
    subsequence: int | None = None

    @property
    def offsets_only(self) -> bool:  # type: ignore[override]
        return self.subsequence is None  # subsequences start at multiples of s from the row

    def __post_init__(self):
        _check_int("LogSparse", "local", self.local, 0)
        if self.subsequence is not None:
            _check_int("LogSparse", "subsequence", self.subsequence, 1)

    def mask(self, i, j, lq, lk):
        d = np.abs(i - j)
        m = (d <= self.local) | _is_power_of_two(d - self.local)
        if self.subsequence is not None:
            m = m & (i // self.subsequence == j // self.subsequence)
        return m

    def _distance_kinds(self, lq, lk, block_q, block_k):
        r0, r1, c0, c1 = Pattern.tile_bounds(lq, lk, block_q, block_k)
        lo, hi = r0 - c1, r1 - c0  # every signed distance in [lo, hi] occurs in the tile
        dmin = np.where((lo <= 0) & (hi >= 0), 0, np.minimum(np.abs(lo), np.abs(hi)))
        dmax = np.maximum(np.abs(lo), np.abs(hi))
        nonempty = dmin <= self.local
        t = 1
        while t <= max(lq, lk):
            nonempty |= (dmin <= self.local + t) & (dmax >= self.local + t)
            t *= 2
        return Pattern.tile_kinds(dmax <= self.local, ~nonempty)

    def block_kinds(self, lq, lk, block_q, block_k):
        kinds = self._distance_kinds(lq, lk, block_q, block_k)
        if self.subsequence is None:
            return kinds
        return np.minimum(kinds, BlockLocal(self.subsequence).block_kinds(lq, lk, block_q, block_k))


@dataclasses.dataclass(frozen=True)
class BlockBERT(Pattern):
    """BlockBERT block-wise attention (Qiu et al., 2020; index rule as in Fournier et al., 2021,
    Eq. 14): the sequence is cut into
    ``num_blocks`` blocks; block ``b`` of the queries sees block ``pi(b) = (b + shift) mod
    num_blocks`` of the keys (the shift permutations of the paper; one per head, see
    :meth:`PerHead.blockbert`). Encoder only."""

    num_blocks: int
    shift: int = 0

    encoder_only: ClassVar[bool] = True

    def __post_init__(self):
        _check_int("BlockBERT", "num_blocks", self.num_blocks, 1)
        _check_int("BlockBERT", "shift", self.shift, 0)

    def mask(self, i, j, lq, lk):
        nb = self.num_blocks
        if nb > min(lq, lk):
            raise ValueError(f"BlockBERT: num_blocks={nb} exceeds the lengths (lq={lq}, lk={lk})")
        # Eq 14 with 0-based positions: block(i) = floor(i * n_b / n).
        qb = np.clip(i, 0, lq - 1) * nb // lq
        kb = np.clip(j, 0, lk - 1) * nb // lk
        return ((qb + self.shift) % nb == kb) & (i < lq) & (j < lk)


@dataclasses.dataclass(frozen=True)
class Longformer(Pattern):
    """Longformer (Beltagy et al., 2020): a sliding window of ``window`` keys on each
    side with gaps of ``dilation``, plus internal global tokens. For separate global
    projections use :func:`xformers_jax.attention.longformer_attention`."""

    window: int
    dilation: int = 1
    global_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "global_tokens", tuple(int(t) for t in self.global_tokens))
        _check_int("Longformer", "window", self.window, 0)
        _check_int("Longformer", "dilation", self.dilation, 1)

    @functools.cached_property
    def _union(self) -> Pattern:
        band = Dilated(self.window, self.window, self.dilation)
        return band | Global(self.global_tokens) if self.global_tokens else band

    def mask(self, i, j, lq, lk):
        return self._union.mask(i, j, lq, lk)

    def block_kinds(self, lq, lk, block_q, block_k):
        return self._union.block_kinds(lq, lk, block_q, block_k)


@dataclasses.dataclass(frozen=True)
class ImageLocal1D(Pattern):
    """Image Transformer 1-D local attention (Parmar et al., 2018): the raster-order sequence is
    cut into query blocks of ``query_block`` positions; each sees its own block and the
    ``memory`` positions before it. The decoder form is this ``& Causal()``."""

    query_block: int
    memory: int

    def __post_init__(self):
        _check_int("ImageLocal1D", "query_block", self.query_block, 1)
        _check_int("ImageLocal1D", "memory", self.memory, 0)

    def _lo(self, i):
        return i // self.query_block * self.query_block - self.memory

    def _hi(self, i):
        return i // self.query_block * self.query_block + self.query_block - 1

    def mask(self, i, j, lq, lk):
        return (j >= self._lo(i)) & (j <= self._hi(i))

    def block_kinds(self, lq, lk, block_q, block_k):
        return _interval_kinds(self._lo, self._hi, lq, lk, block_q, block_k)


@dataclasses.dataclass(frozen=True)
class ImageLocal2D(Pattern):
    """Image Transformer 2-D local attention (Parmar et al., 2018).

    A ``height x width`` image is cut into ``query_shape = (h_q, w_q)`` query blocks; the memory
    block extends a query block ``h_m`` rows up and ``w_m`` columns left and right
    (``memory_shape = (h_m, w_m)``). Positions are in generation order: query blocks in raster
    order, pixels in raster order within a block (:meth:`pixel` maps a position to its
    (row, col)), so the decoder form is exactly this ``& Causal()``. Needs L = height * width.
    """

    height: int
    width: int
    query_shape: tuple[int, int]
    memory_shape: tuple[int, int]

    def __post_init__(self):
        object.__setattr__(self, "query_shape", tuple(int(x) for x in self.query_shape))
        object.__setattr__(self, "memory_shape", tuple(int(x) for x in self.memory_shape))
        qh, qw = self.query_shape
        for name, v, lo in (("height", self.height, 1), ("width", self.width, 1),
                            ("query_shape[0]", qh, 1), ("query_shape[1]", qw, 1),
                            ("memory_shape[0]", self.memory_shape[0], 0),
                            ("memory_shape[1]", self.memory_shape[1], 0)):
            _check_int("ImageLocal2D", name, v, lo)
        if self.height % qh or self.width % qw:
            raise ValueError(
                f"ImageLocal2D: query_shape {self.query_shape} must tile the image "
                f"({self.height} x {self.width})"
            )

    def pixel(self, p):
        """``(row, col)`` of sequence position(s) ``p``."""
        qh, qw = self.query_shape
        block, within = np.divmod(p, qh * qw)
        br, bc = np.divmod(block, self.width // qw)
        wr, wc = np.divmod(within, qw)
        return br * qh + wr, bc * qw + wc

    def mask(self, i, j, lq, lk):
        n = self.height * self.width
        if lq != n or lk != n:
            raise ValueError(f"ImageLocal2D: lengths (lq={lq}, lk={lk}) must equal height * width = {n}")
        qh, qw = self.query_shape
        mh, mw = self.memory_shape
        ri, ci = self.pixel(np.clip(i, 0, n - 1))
        rj, cj = self.pixel(np.clip(j, 0, n - 1))
        top, left = ri // qh * qh, ci // qw * qw
        inside = (rj >= top - mh) & (rj < top + qh) & (cj >= left - mw) & (cj < left + qw + mw)
        return inside & (i < n) & (j < n)


@dataclasses.dataclass(frozen=True)
class BPTree(Pattern):
    """BP-Transformer's binary partition tree (Ye et al., 2019), as a pattern over tokens
    followed by span nodes.

    Positions ``0 .. num_tokens - 1`` are the tokens (leaves); then come the span nodes, level
    by level: level ``l >= 1`` has ``ceil(num_tokens / 2**l)`` nodes, node ``b`` spanning tokens
    ``[b * 2**l, (b + 1) * 2**l)``. A token sees tokens within distance ``k`` and, at every
    level, the ``k`` span nodes on each side of its own ancestor (coarser context further away);
    a span node sees itself and its two children. :attr:`length` is the sequence length this
    pattern needs. Encoder only.
    """

    num_tokens: int
    k: int = 1

    encoder_only: ClassVar[bool] = True

    def __post_init__(self):
        _check_int("BPTree", "num_tokens", self.num_tokens, 1)
        _check_int("BPTree", "k", self.k, 1)

    @functools.cached_property
    def _nodes(self) -> tuple[np.ndarray, np.ndarray]:
        levels, index = [np.zeros(self.num_tokens, np.int64)], [np.arange(self.num_tokens)]
        level, count = 0, self.num_tokens
        while count > 1:
            level, count = level + 1, cdiv(count, 2)
            levels.append(np.full(count, level, np.int64))
            index.append(np.arange(count, dtype=np.int64))
        return np.concatenate(levels), np.concatenate(index)

    @property
    def length(self) -> int:
        return len(self._nodes[0])

    def mask(self, i, j, lq, lk):
        n = self.length
        if lq != n or lk != n:
            raise ValueError(f"BPTree: lengths (lq={lq}, lk={lk}) must equal BPTree.length = {n}")
        level, index = self._nodes
        valid = (i >= 0) & (i < n) & (j >= 0) & (j < n)
        li, bi = level[np.clip(i, 0, n - 1)], index[np.clip(i, 0, n - 1)]
        lj, bj = level[np.clip(j, 0, n - 1)], index[np.clip(j, 0, n - 1)]
        ancestor = bi >> lj  # the query token's ancestor at the key's level
        token_query = (li == 0) & (np.abs(bj - ancestor) <= self.k) & ((lj == 0) | (bj != ancestor))
        span_query = (li > 0) & (((lj == li) & (bj == bi)) | ((lj == li - 1) & (bj >> 1 == bi)))
        return (token_query | span_query) & valid


@dataclasses.dataclass(frozen=True)
class PerHead:
    """One pattern per attention head (the Sparse Transformer, Child et al., 2019, gives half of
    the heads each pattern; BlockBERT, Qiu et al., 2020, a permutation per head). Run it with
    :func:`xformers_jax.attention.per_head_block_sparse_attention`, which groups the heads that
    share a pattern."""

    patterns: tuple[Pattern, ...]

    def __post_init__(self):
        object.__setattr__(self, "patterns", tuple(self.patterns))
        if not self.patterns or not all(isinstance(p, Pattern) for p in self.patterns):
            raise ValueError(f"PerHead: patterns must be a non-empty tuple of Patterns, got {self.patterns!r}")

    @property
    def num_heads(self) -> int:
        return len(self.patterns)

    @property
    def causal_safe(self) -> bool:
        return all(p.causal_safe for p in self.patterns)

    def groups(self) -> tuple[tuple[Pattern, tuple[int, ...]], ...]:
        """``(pattern, head indices)`` for each distinct pattern, in order of first use."""
        heads: dict[Pattern, list[int]] = {}
        for h, p in enumerate(self.patterns):
            heads.setdefault(p, []).append(h)
        return tuple((p, tuple(h)) for p, h in heads.items())

    def dense(self, lq: int, lk: int) -> np.ndarray:
        """``bool[H, lq, lk]``."""
        return np.stack([p.dense(lq, lk) for p in self.patterns])

    @classmethod
    def sparse_transformer(cls, num_heads: int, stride: int, kind: str = "strided", c: int = 1):
        """Sparse Transformer's factorised heads: the first half takes the local (or block) part,
        the second half the strided (or summary) part."""
        _check_int("PerHead.sparse_transformer", "num_heads", num_heads, 2)
        if kind == "strided":
            a, b = Strided(stride, "local"), Strided(stride, "strided")
        elif kind == "fixed":
            a, b = Fixed(stride, c, "block"), Fixed(stride, c, "summary")
        else:
            raise ValueError(f"PerHead.sparse_transformer: kind must be 'strided' or 'fixed', got {kind!r}")
        half = num_heads // 2
        return cls((a,) * half + (b,) * (num_heads - half))

    @classmethod
    def blockbert(cls, num_heads: int, num_blocks: int):
        """BlockBERT: head ``h`` uses the shift permutation ``h mod num_blocks`` (Fournier et al.,
        2021, footnote 9: with more heads than permutations, heads share them)."""
        _check_int("PerHead.blockbert", "num_heads", num_heads, 1)
        return cls(tuple(BlockBERT(num_blocks, h % num_blocks) for h in range(num_heads)))
