"""Exact attention over the tiles a :class:`BlockLayout` lists: the XLA path of flash attention.

Rabe & Staats, "Self-attention Does Not Need O(n^2) Memory" (2021); Dao et al.,
"FlashAttention" (2022). Scores are never held beyond one ``block_q x block_k`` tile: a
``lax.scan`` walks the layout's compacted list of non-empty tiles, keeping a running maximum,
normaliser and output accumulator per query row (the online softmax). The backward pass is a
``jax.custom_vjp`` that recomputes each tile from the saved log-sum-exp instead of storing the
probabilities (``_vjp.lse_vjp``; the tile math is ``_tiles``'s, shared with the Pallas
kernels), so forward plus backward memory is linear in the sequence length and the work
is proportional to the number of non-empty tiles (causal does about half, a band much less).

Why a flat scan over tiles rather than "map over query blocks, scan over key blocks": rows of
a sparse or causal layout hold different numbers of tiles, and a scan over the compacted list
does exactly the listed work with static shapes, which is also what keeps the skipping real
under ``jax.vmap`` (a data-dependent ``lax.cond`` would turn into a select and do it all).
Full tiles and partial tiles run in two scans so full tiles carry no in-tile mask. Segment
ids (packed rows, data) are the one run-time skip: each listed tile's query and key id ranges
decide whether it is computed, and the computed ones are walked by loops of data-dependent
length (``_scan_tiles``), which stay loops under a ``vmap`` over heads.

The backward pass over small tiles (a pattern tiled at 64, like BigBird's blocks) is
row-gathered: one scan step takes ``gather`` of a query block's non-empty key tiles at once,
gathering their keys and values into one ``[bq, gather * bk]`` score tile (rows padded with
masked dummy tiles), so the per-step cost of the scan and its read-modify-writes of dq are
paid once per group rather than once per tile (:func:`_gather_width` picks the group size).
BigBird(64) fwd+bwd at L=8192, H=4 on a 2-core Sapphire Rapids: 343 against 405 ms. The
forward keeps one tile per step: gathered, it was slower (112 against 90 ms), the gathers'
copies and the group's mask costing more than the steps saved.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from . import _tiles
from ._tiles import STATS_DTYPE, pad_to
from ._layout import BlockLayout
from ._vjp import lse_vjp


@dataclasses.dataclass(frozen=True, eq=False)
class _Static(_tiles.TileConfig):
    """Everything static about one call (hashed by identity): the shared tile configuration
    (scale, which dynamic masks are present) plus this back end's own fields."""

    layout: BlockLayout
    dropout_rate: float
    bias_fn: Callable[..., Any] | None  # see _convert
    bias_is_array: bool
    # The score scale is applied to q once, before the tile scans, rather than to every
    # [bq, bk] score tile: XLA:CPU ran the tile's ``s * scale`` as a fusion of its own feeding
    # the row maximum (one more write and read of the tile per step). Exact when q is float32
    # (the product is rounded once either way, to float32) or the scale is a power of two;
    # otherwise (a bf16 q and a scale like 1/sqrt(48)) the tiles are scaled as before.
    scale_folded: bool
    # Row-gathered tiles per backward scan step (0: one tile per step), see
    # ``_gather_width``; when set, ``dyn``'s masks are ``_gather_masks``'s table.
    gather: int = 0
    # Flex attention (Dong et al., 2024, "Flex Attention"): ``score_fn(s, b, h, q_pos, k_pos,
    # floats, others)`` replaces each tile's scores (after the scale and any bias), and
    # ``mask_fn(b, h, q_pos, k_pos, consts)`` masks them in-tile as data; both are closure
    # converted (:func:`_convert`) and evaluated at natural ``[bq, bk]`` tiles. ``has_sink``:
    # every row's softmax has one more logit, the sink, with no value (the online softmax
    # starts from it).
    score_fn: Callable[..., Any] | None = None
    # The score function traced at the backward's transposed tile (``s [bk, bq]``, ``q_pos
    # [1, bq]``, ``k_pos [bk, 1]``, same captures), where :func:`_transposed_score` shows
    # it orientation-free; None: transposed tiles are turned round for it.
    score_fn_t: Callable[..., Any] | None = None
    mask_fn: Callable[..., Any] | None = None
    has_sink: bool = False
    # A score function whose last step multiplies by a positive constant ``c`` (Gemma's
    # soft-cap ``c * tanh(s / c)``): ``(inner, c)`` with ``score = c * inner``, see
    # :func:`_positive_scale`; the forward takes the row maximum of ``inner``. None otherwise.
    score_scaled: tuple[Callable[..., Any], float] | None = None

    __eq__ = object.__eq__
    __hash__ = object.__hash__


class _Tile:
    """The score tile (qi, kj) and its masks, shared by the forward and the backward scans.

    With ``transposed`` the tile is built as ``s^T [bk, bq]`` from ``k`` and the pre-transposed
    queries ``qT [Dk, Lq]`` (the backward's orientation, see :func:`_backward`); masks, bias and
    dropout decisions are the same entries, transposed.
    """

    def __init__(self, st: _Static, q, k, dyn, extra, qi, kj, mi, with_static_mask: bool,
                 transposed: bool = False, gathered: bool = False):
        bias, self.score_floats, _ = extra
        self.transposed = transposed
        lay = st.layout
        bq, bk = lay.block_q, lay.block_k
        self.q0 = qi * bq
        q_rows = self.q0 + jnp.arange(bq, dtype=jnp.int32)
        if gathered:  # kj, mi: int32[gather]; the keys of those tiles, side by side
            self.k0 = None
            self.kj = kj
            k_rows = (kj[:, None] * bk + jnp.arange(bk, dtype=jnp.int32)).reshape(-1)
            keys = lambda x: _gather_blocks(x, kj, bk)  # noqa: E731
        else:
            self.k0 = kj * bk
            k_rows = self.k0 + jnp.arange(bk, dtype=jnp.int32)
            keys = lambda x: jax.lax.dynamic_slice_in_dim(x, self.k0, bk)  # noqa: E731
        self.keys, self.k_rows = keys, k_rows
        # (q_pos [bq, 1], k_pos [1, bk]): the positions a callable bias is evaluated at.
        self.positions = (q_rows[:, None], k_rows[None, :])
        self.k = keys(k)
        kv_mask, q_seg, kv_seg, seed, masks, self.bias_data, self.mods = dyn
        mask = _tiles.dynamic_mask(
            keys(kv_mask) if st.has_kv_mask else None,
            jax.lax.dynamic_slice_in_dim(q_seg, self.q0, bq) if st.has_segments else None,
            keys(kv_seg) if st.has_segments else None,
        )
        if transposed:
            mask = None if mask is None else mask.T
            self.q_pos, self.k_pos = q_rows[None, :], k_rows[:, None]
            q_t = jax.lax.dynamic_slice_in_dim(q, self.q0, bq, axis=1)
            s = jnp.einsum("kd,dq->kq", self.k, q_t, preferred_element_type=STATS_DTYPE)
        else:
            self.q_pos, self.k_pos = q_rows[:, None], k_rows[None, :]
            q_t = jax.lax.dynamic_slice_in_dim(q, self.q0, bq)
            s = jnp.einsum("qd,kd->qk", q_t, self.k, preferred_element_type=STATS_DTYPE)
        if gathered:  # masks [bq, n, bk]: the partial masks, all-True (full), all-False (pad)
            mask = _tiles.and_masks(mask, masks[:, mi].reshape(bq, -1))
        elif with_static_mask:  # the caller transposes ``masks``
            mask = _tiles.and_masks(mask, masks[:, mi] if st.gather else masks[mi])
        if not st.scale_folded:
            s = s * st.scale
        if st.bias_is_array and gathered:
            rows = jax.lax.dynamic_slice_in_dim(bias, self.q0, bq)
            s = s + jnp.take(rows, k_rows, axis=1).astype(STATS_DTYPE)
        elif st.bias_is_array:  # the caller transposes an array bias
            at, size = ((self.k0, self.q0), (bk, bq)) if transposed else (
                (self.q0, self.k0), (bq, bk))
            s = s + jax.lax.dynamic_slice(bias, at, size).astype(STATS_DTYPE)
        elif st.bias_fn is not None:
            b = self.callable_bias(st, bias)
            s = s + (b.T if transposed else b).astype(STATS_DTYPE)
        self.inner = None
        if st.score_fn is not None:
            self.s_raw = s
            if st.score_scaled is not None and not transposed and not gathered:
                inner, c = st.score_scaled
                bh, others, _ = self.mods
                self.inner = jnp.broadcast_to(inner(s, bh[0], bh[1], self.q_pos, self.k_pos,
                                                    self.score_floats, others),
                                              s.shape).astype(STATS_DTYPE)
                s = self.inner * jnp.asarray(c, STATS_DTYPE)
            else:
                s = self.score(st, s, self.score_floats)
        if st.mask_fn is not None:
            bh, _, mask_consts = self.mods
            mask = _tiles.and_masks(mask, self.by_key_tile(st, lambda qp, kp: jnp.broadcast_to(
                st.mask_fn(bh[0], bh[1], qp, kp, [], mask_consts), (qp.shape[0], kp.shape[1]))))
        self.mask = mask
        self.s = s if mask is None else jnp.where(mask, s, -jnp.inf)
        self.keep = (
            _tiles.dropout_keep(seed, self.q_pos, self.k_pos, st.dropout_rate)
            if st.dropout_rate > 0.0
            else None
        )

    def callable_bias(self, st: _Static, consts):
        """The callable bias over this tile's positions, ``[bq, keys]``. A gathered tile
        evaluates it per key tile: its jaxpr was traced at ``[bq, 1] x [1, bk]``."""
        q_pos, k_pos = self.positions
        bk = st.layout.block_k
        if k_pos.shape[1] == bk:
            return st.bias_fn(q_pos, k_pos, consts, self.bias_data)
        return jnp.concatenate(
            [st.bias_fn(q_pos, k_pos[:, i : i + bk], consts, self.bias_data)
             for i in range(0, k_pos.shape[1], bk)], axis=1)

    def by_key_tile(self, st: _Static, fn, *tiles):
        """``fn(q_pos [bq, 1], k_pos [1, bk], *tiles [bq, bk]) -> [bq, bk]`` over this tile,
        evaluated in the natural orientation one key tile at a time (a flex function's jaxpr
        was traced at one ``[bq, bk]`` tile) and returned in the tile's orientation."""
        q_pos, k_pos = self.positions
        bk = st.layout.block_k
        tiles = [x.T if self.transposed else x for x in tiles]
        if k_pos.shape[1] == bk:
            out = fn(q_pos, k_pos, *tiles)
        else:
            out = jnp.concatenate(
                [fn(q_pos, k_pos[:, i : i + bk], *[x[:, i : i + bk] for x in tiles])
                 for i in range(0, k_pos.shape[1], bk)], axis=1)
        return out.T if self.transposed else out

    def score(self, st: _Static, s, floats):
        """The flex score function over the tile's scores ``s`` (float32)."""
        bh, others, _ = self.mods
        if self.transposed and st.score_fn_t is not None:
            # Evaluated as the tile lies: turning a [bk, bq] tile round for the function
            # and back cost four tile transposes per backward step (two for its vjp), which
            # XLA:CPU ran as copies.
            return jnp.broadcast_to(st.score_fn_t(s, bh[0], bh[1], self.q_pos, self.k_pos,
                                                  floats, others), s.shape).astype(STATS_DTYPE)
        return self.by_key_tile(st, lambda qp, kp, x: jnp.broadcast_to(
            st.score_fn(x, bh[0], bh[1], qp, kp, floats, others), x.shape
        ).astype(STATS_DTYPE), s)

    def dropped(self, p, rate):
        return p if self.keep is None else jnp.where(self.keep, p / (1.0 - rate), 0.0)


def _tile_groups(layout: BlockLayout):
    """The non-empty tiles split into (full, partial) lists of ``(q_block, k_block, mask)``."""
    qb, kb, mi = layout.pairs
    full = mi < 0
    return (
        (qb[full], kb[full], np.zeros_like(mi[full])),
        (qb[~full], kb[~full], mi[~full]),
    )


def _gather_blocks(x, idx, size: int):
    """Rows ``idx[i] * size ... + size`` of ``x`` for each ``i``, side by side:
    ``[len(idx) * size, ...]``. One dynamic slice per block: XLA:CPU runs these as copies,
    where a gather of whole blocks was slower."""
    return jnp.concatenate(
        [jax.lax.dynamic_slice_in_dim(x, idx[i] * size, size) for i in range(idx.shape[0])])


def _add_blocks(x, idx, size: int, upd):
    """``x`` with ``upd [len(idx) * size, ...]`` added to the blocks ``idx`` (repeats add),
    one read-modify-write per block (no scatter)."""
    for i in range(idx.shape[0]):
        start = idx[i] * size
        old = jax.lax.dynamic_slice_in_dim(x, start, size)
        x = jax.lax.dynamic_update_slice_in_dim(x, old + upd[i * size : (i + 1) * size], start, 0)
    return x


# Row gathering (see the module docstring) applies to tiles of at most this many keys, and
# gathers up to ``_GATHER_KEYS`` keys per step.
_GATHER_MAX_BK = 128
_GATHER_KEYS = 512
# The scan's per-step cost in tile-equivalents, weighed against the padded (masked) tiles a
# larger group wastes on rows whose tile count it does not divide.
_STEP_COST_TILES = 3


def _gather_width(layout: BlockLayout) -> int:
    """Tiles per row-gathered scan step for ``layout`` (0: not gathered).

    Gathered when tiles have at most ``_GATHER_MAX_BK`` keys and some query block holds at
    least two tiles. The group size ``r <= _GATHER_KEYS // bk`` minimises the rows' padded
    work plus the per-step cost, ``sum_i ceil(n_i / r) (r + _STEP_COST_TILES)`` over the
    rows' tile counts ``n_i``: BigBird(64) at L=8192 (7-8 tiles per row but the global ones)
    gets 8, ``Local(256, 256)`` at 64 x 64 tiles (9 per row) 5.
    """
    if layout.block_k > _GATHER_MAX_BK:
        return 0
    counts = layout.row_counts[layout.row_counts > 0].astype(np.int64)
    if counts.size == 0 or counts.max() < 2:
        return 0
    widest = max(1, min(int(counts.max()), _GATHER_KEYS // layout.block_k))
    cost = {r: int((-(-counts // r) * (r + _STEP_COST_TILES)).sum())
            for r in range(1, widest + 1)}
    r = min(cost, key=lambda r: (cost[r], -r))
    return r if r > 1 else 0


def _gathered_rows(layout: BlockLayout, r: int):
    """The row-gathered work list: ``(q_block [n], k_blocks [n, r], mask [n, r])``.

    Each query block's non-empty tiles in groups of ``r``, the last group padded with tiles
    whose mask index selects an all-False mask. Mask indices point into the partial masks
    followed by an all-True mask (full tiles) and an all-False one (padding): see
    :func:`_gather_masks`.
    """
    qb, kb, mi = layout.pairs
    n_part = len(layout.partial_masks)
    code = np.where(mi < 0, n_part, mi)
    rows_q, rows_k, rows_m = [], [], []
    for i in np.unique(qb):
        ks, ms = kb[qb == i], code[qb == i]
        pad = (-len(ks)) % r
        ks = np.concatenate([ks, np.full(pad, ks[0], np.int32)])
        ms = np.concatenate([ms, np.full(pad, n_part + 1, np.int32)])
        for c in range(0, len(ks), r):
            rows_q.append(i)
            rows_k.append(ks[c : c + r])
            rows_m.append(ms[c : c + r])
    return (np.asarray(rows_q, np.int32), np.stack(rows_k).astype(np.int32),
            np.stack(rows_m).astype(np.int32))


def _gather_masks(layout: BlockLayout) -> np.ndarray:
    """The partial masks followed by an all-True and an all-False tile mask, laid out
    ``[bq, n, bk]`` so a group's masks side by side are a reshape of one gather."""
    shape = (1, layout.block_q, layout.block_k)
    masks = np.concatenate([layout.partial_masks.reshape((-1,) + shape[1:]),
                            np.ones(shape, bool), np.zeros(shape, bool)])
    return np.ascontiguousarray(masks.transpose(1, 0, 2))


def _work_groups(st: "_Static", gathered: bool):
    """The scans to run: ``[(work list, with_static_mask), ...]``."""
    if gathered:
        return [(_gathered_rows(st.layout, st.gather), True)]
    return [(g, m) for g, m in zip(_tile_groups(st.layout), (False, True)) if len(g[0])]


def _segment_ranges(seg, length: int, block: int):
    """``(lo, hi)``, int32[blocks]: the smallest and largest segment id of each block's real
    positions (the first ``length`` of the padded ids ``seg``)."""
    valid = jnp.arange(seg.shape[0]) < length
    info = jnp.iinfo(seg.dtype)
    lo = jnp.where(valid, seg, info.max).reshape(-1, block).min(axis=1)
    hi = jnp.where(valid, seg, info.min).reshape(-1, block).max(axis=1)
    return lo, hi


def _segment_kinds(st: _Static, dyn, group) -> jax.Array:
    """int32[n]: for each listed tile, 0 when all its queries and keys are of one segment
    (its segment mask is all True), 1 when their id ranges overlap otherwise (it may hold a
    pair of one segment), 2 when they do not (it is all masked: skipping it leaves every
    output and gradient as it was, bit for bit)."""
    lay = st.layout
    _, q_seg, kv_seg, *_ = dyn
    q_lo, q_hi = _segment_ranges(q_seg, lay.lq, lay.block_q)
    k_lo, k_hi = _segment_ranges(kv_seg, lay.lk, lay.block_k)
    qb, kb = jnp.asarray(group[0]), jnp.asarray(group[1])
    meet = (q_lo[qb] <= k_hi[kb]) & (k_lo[kb] <= q_hi[qb])
    one = (q_lo[qb] == q_hi[qb]) & (k_lo[kb] == k_hi[kb]) & (q_lo[qb] == k_lo[kb])
    return jnp.where(one, 0, jnp.where(meet, 1, 2)).astype(jnp.int32)


# The forward pass walks a layout of at most this block density whose key blocks are each used
# by at most this many query blocks on average with a ``lax.while_loop`` instead of a
# ``lax.scan`` (see ``_walk_by_while``).
_WHILE_MAX_USES = 4.0
_WHILE_MAX_DENSITY = 0.25


def _walk_by_while(layout: BlockLayout) -> bool:
    """Whether the forward pass walks ``layout``'s tiles with a ``lax.while_loop``.

    Under ``jax.vmap`` (heads and batch rows, as ``multihead`` maps a head's kernel), a scan's
    batching rule moves the batch axis of every array the scan closes over to the front before
    the loop: a transposed copy of all of K and V per call, which XLA:CPU ran as two passes
    over each (a copy and a transpose). A while loop keeps the arrays as they are and lays out
    each tile's keys and values as it uses them. That pays off when each key block is used by
    few query blocks (a band, packed documents), not when it is used by many (causal and full
    layouts keep the scan, whatever their length). Fwd at L=8192, H=4, D=64 on the 2-core
    EPYC (CPU time, scan against while loop): 8 causal documents of 1K 131 against 96 ms
    (1.5 uses per key block, 9% of the tiles), the ~10% band 200 against 181 (2.9 uses, 18%),
    causal 534 against 554 (8.5), full 940 against 964 (16); ``block_sparse_attention``
    with ``Local(w, w)`` at its tile: 91 against 73 ms (w = 128), 129 against 109 (256), 196
    against 189 (512); BigBird(64) (9.9 uses, kept on the scan) 133 against 131. Outputs are
    bit-identical (the same steps in the same order)."""
    used = np.count_nonzero(layout.kinds, axis=0)
    used = used[used > 0]
    return (used.size > 0 and layout.density <= _WHILE_MAX_DENSITY
            and float(used.mean()) <= _WHILE_MAX_USES)


def _scan_tiles(st: _Static, dyn, body, carry, group, while_loop: bool = False):
    """Runs ``body(carry, (q_block, k_block, mask), tile_st=st) -> (carry, None)`` over the
    work list ``group``; returns the carry.

    With segment ids (packed sequences; data, known only at run time) the tiles whose query
    and key id ranges cannot meet are skipped, and the tiles of one segment only apply no
    segment mask: the list is sorted by :func:`_segment_kinds` (stably) and two loops of
    data-dependent lengths walk the one-segment tiles (``tile_st`` without segments) and then
    the mixed ones, so a row of 8 documents does the work of their diagonal tiles, not of the
    whole layout, at the cost per tile of no segments. Under ``jax.vmap`` over rows with
    different ids each loop runs the most steps any row needs (finished rows' steps are
    selected away); over heads sharing the ids they stay plain loops. Calls with segment ids
    list single tiles (no row gathering), so a skipped tile's keys and values reach nothing.
    Without segment ids: a scan over the static list, or with ``while_loop`` a while loop
    over it (:func:`_walk_by_while`)."""
    xs = tuple(map(jnp.asarray, group))
    if not st.has_segments and while_loop:
        n = len(group[0])

        def step_at(c):
            i, c = c
            return i + 1, body(c, tuple(x[i] for x in xs))[0]

        return jax.lax.while_loop(lambda c: c[0] < n, step_at, (jnp.int32(0), carry))[1]
    if not st.has_segments:
        return jax.lax.scan(body, carry, xs)[0]
    kinds = _segment_kinds(st, dyn, group)
    order = jnp.argsort(kinds, stable=True)
    n_one = jnp.sum((kinds == 0).astype(jnp.int32))
    n_meet = n_one + jnp.sum((kinds == 1).astype(jnp.int32))
    one_segment = dataclasses.replace(st, has_segments=False)

    def step(tile_st):
        return lambda i, carry: body(carry, tuple(x[order[i]] for x in xs), tile_st=tile_st)[0]

    carry = jax.lax.fori_loop(0, n_one, step(one_segment), carry)
    return jax.lax.fori_loop(n_one, n_meet, step(st), carry)


def _fold_scale(st: _Static, q):
    """``q`` with the score scale applied when the call folds it (``_Static.scale_folded``)."""
    if not st.scale_folded:
        return q
    return (q.astype(STATS_DTYPE) * st.scale).astype(q.dtype)


def _forward(st: _Static, q, k, v, extra, dyn):
    lay = st.layout
    q = _fold_scale(st, q)
    bq = lay.block_q
    lq_p = lay.num_q_blocks * bq
    acc = jnp.zeros((lq_p, v.shape[1]), STATS_DTYPE)
    if st.has_sink:  # the sink logit is every row's first score: m = sink, l = exp(0)
        m = jnp.full((lq_p, 1), extra[2].astype(STATS_DTYPE), STATS_DTYPE)
        l = jnp.ones((lq_p, 1), STATS_DTYPE)
    else:
        m = jnp.full((lq_p, 1), -jnp.inf, STATS_DTYPE)
        l = jnp.zeros((lq_p, 1), STATS_DTYPE)

    for group, with_mask in _work_groups(st, gathered=False):

        def body(carry, xs, with_mask=with_mask, tile_st=st):
            acc, m, l = carry
            qi, kj, mi = xs
            t = _Tile(tile_st, q, k, dyn, extra, qi, kj, mi, with_mask)
            v_t = t.keys(v)
            row_max = None
            if t.inner is not None:
                # max(c * x) = c * max(x) exactly for c > 0 (rounding is monotone), and the
                # maximum then reads the function's inner result, which XLA:CPU writes out
                # anyway, instead of a second copy of the tile scaled by c (its row-maximum
                # reduction takes no producer): one pass over each tile fewer.
                inner = t.inner if t.mask is None else jnp.where(t.mask, t.inner, -jnp.inf)
                row_max = inner.max(axis=-1, keepdims=True) * jnp.asarray(
                    st.score_scaled[1], STATS_DTYPE)
            m_new, l_new, a_new = _tiles.online_step(
                t.s,
                jax.lax.dynamic_slice_in_dim(m, t.q0, bq),
                jax.lax.dynamic_slice_in_dim(l, t.q0, bq),
                jax.lax.dynamic_slice_in_dim(acc, t.q0, bq),
                lambda p: jnp.einsum(
                    "qk,kd->qd",
                    t.dropped(p, st.dropout_rate).astype(v.dtype),
                    v_t,
                    preferred_element_type=STATS_DTYPE,
                ),
                row_max=row_max,
            )
            acc = jax.lax.dynamic_update_slice_in_dim(acc, a_new, t.q0, 0)
            m = jax.lax.dynamic_update_slice_in_dim(m, m_new, t.q0, 0)
            l = jax.lax.dynamic_update_slice_in_dim(l, l_new, t.q0, 0)
            return (acc, m, l), None

        acc, m, l = _scan_tiles(st, dyn, body, (acc, m, l), group,
                                while_loop=_walk_by_while(lay))

    out, lse = _tiles.finish(m, l, acc)
    return out, lse[:, 0]


# Tiles of at least this many scores are computed transposed in the backward pass (see
# ``_backward``). Measured fwd+bwd over Full() at L=2048, H=4, D=64 on the 2-core EPYC,
# transposed against natural: 0.69x the time at 512 x 512 tiles, 0.97x at 256, 0.91x at 128,
# but 1.13x at 64 x 64, where the extra slices of the transposed copies cost more than the
# products save.
_TRANSPOSE_FROM = 128 * 128


def _transposed(layout: BlockLayout, gather: int) -> bool:
    """Whether the backward computes ``layout``'s tiles transposed (see :func:`_backward`)."""
    return layout.block_q * layout.block_k >= _TRANSPOSE_FROM and not gather


def _backward(st: _Static, q, k, v, extra, dyn, out, lse, d_out, d_lse):
    """Recomputes each listed tile from the saved log-sum-exp and accumulates dq, dk, dv.

    Tiles of ``_TRANSPOSE_FROM`` scores or more are computed transposed, ``[bk, bq]``, from
    pre-transposed copies of q, k and the output cotangent (``[D, L]``, made once), so each of
    the five products is a plain ``[m, n] @ [n, p]`` matmul; dq is then accumulated
    transposed and turned round once at the end. In the natural orientation the ``p^T dO``
    and ``ds^T q`` products contract the leading axis of both operands, which XLA:CPU ran 2.6x
    slower than a plain matmul (a 512 x 512 tile's backward: 1.73 against 1.07 ms).

    A flex score function is differentiated inside the tile: the softmax backward gives the
    cotangent of the modified scores, ``jax.vjp`` of the score function at the tile's raw
    scores turns it into theirs (for dq, dk) and into its captured arrays' (summed over the
    tiles). A sink logit ``z`` (one per row's softmax, no value) gets
    ``-sum_i exp(z - lse_i) delta_i``.
    """
    bias, score_floats, sink = extra
    lay = st.layout
    bq, bk = lay.block_q, lay.block_k
    tr = _transposed(lay, st.gather)
    lse, delta = _tiles.backward_stats(out, lse, d_out, d_lse)
    q = _fold_scale(st, q)  # then dk = ds^T (scale q) needs no further scale
    k_scale = 1.0 if st.scale_folded else st.scale
    q_in, k_T, d_out_T = (q.T, k.T, d_out.T) if tr else (q, None, None)
    if tr:
        kv_mask, q_seg, kv_seg, seed, masks, bias_data, mods = dyn
        dyn = (kv_mask, q_seg, kv_seg, seed, jnp.swapaxes(masks, 1, 2), bias_data, mods)
    bias_in = bias.T if tr and st.bias_is_array else bias
    q_axis = 1 if tr else 0  # dq's query axis (dq is [D, Lq] when transposed)
    dq = jnp.zeros(q_in.shape, STATS_DTYPE)
    dk = jnp.zeros(k.shape, STATS_DTYPE)
    dv = jnp.zeros(v.shape, STATS_DTYPE)
    if st.bias_is_array:
        d_bias = jnp.zeros(bias_in.shape, STATS_DTYPE)
    else:
        d_bias = jax.tree_util.tree_map(lambda c: jnp.zeros(c.shape, STATS_DTYPE), bias)
    d_score = jax.tree_util.tree_map(lambda c: jnp.zeros(c.shape, STATS_DTYPE), score_floats)

    def per_query(x):  # a per-query vector against the oriented tile
        return x[None, :] if tr else x[:, None]

    def mm(spec, a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=STATS_DTYPE)

    gathered = bool(st.gather)
    for group, with_mask in _work_groups(st, gathered):

        def body(carry, xs, with_mask=with_mask, tile_st=st):
            dq, dk, dv, d_bias, d_score = carry
            qi, kj, mi = xs
            t = _Tile(tile_st, q_in, k, dyn, (bias_in, score_floats, sink), qi, kj, mi, with_mask,
                      transposed=tr, gathered=gathered)
            q_t = jax.lax.dynamic_slice_in_dim(q, t.q0, bq)
            v_t = t.keys(v)
            do_t = jax.lax.dynamic_slice_in_dim(d_out, t.q0, bq)
            lse_t = jax.lax.dynamic_slice_in_dim(lse, t.q0, bq)
            delta_t = jax.lax.dynamic_slice_in_dim(delta, t.q0, bq)
            p = _tiles.tile_probs(t.s, per_query(lse_t))
            p_drop = t.dropped(p, st.dropout_rate).astype(do_t.dtype)
            if tr:
                do_T = jax.lax.dynamic_slice_in_dim(d_out_T, t.q0, bq, axis=1)
                dv_t, dp = mm("kq,qd->kd", p_drop, do_t), mm("kd,dq->kq", v_t, do_T)
            else:
                dv_t, dp = mm("qk,qd->kd", p_drop, do_t), mm("qd,kd->qk", do_t, v_t)
            ds = _tiles.score_grad(p, t.dropped(dp, st.dropout_rate), per_query(delta_t))
            if st.score_fn is not None:
                _, pull = jax.vjp(lambda s, c: t.score(st, s, c), t.s_raw, score_floats)
                ds, d_c = pull(ds)
                if t.mask is not None:  # 0 * (an infinite derivative) at masked scores
                    ds = jnp.where(t.mask, ds, 0.0)
                d_score = jax.tree_util.tree_map(
                    lambda a, g: a + g.astype(STATS_DTYPE), d_score, d_c)
            ds_c = ds.astype(q.dtype)
            if tr:
                k_T_t = jax.lax.dynamic_slice_in_dim(k_T, t.k0, bk, axis=1)
                dq_t, dk_t = mm("dk,kq->dq", k_T_t, ds_c), mm("kq,qd->kd", ds_c, q_t)
            else:
                dq_t, dk_t = mm("qk,kd->qd", ds_c, t.k), mm("qk,qd->kd", ds_c, q_t)

            def add(buf, upd, start, axis=0):
                old = jax.lax.dynamic_slice_in_dim(buf, start, upd.shape[axis], axis=axis)
                return jax.lax.dynamic_update_slice_in_dim(buf, old + upd, start, axis)

            dq = add(dq, dq_t * st.scale, t.q0, q_axis)
            dk_t = dk_t * k_scale if k_scale != 1.0 else dk_t
            if gathered:
                dk, dv = _add_blocks(dk, t.kj, bk, dk_t), _add_blocks(dv, t.kj, bk, dv_t)
            else:
                dk, dv = add(dk, dk_t, t.k0), add(dv, dv_t, t.k0)
            if st.bias_is_array and gathered:
                d_bias = d_bias.at[(t.q0 + jnp.arange(bq))[:, None], t.k_rows[None, :]].add(ds)
            elif st.bias_is_array:
                d_bias = jax.lax.dynamic_update_slice(
                    d_bias, ds, (t.k0, t.q0) if tr else (t.q0, t.k0))
            elif st.bias_fn is not None and d_bias:
                _, pull = jax.vjp(
                    lambda *c: t.callable_bias(st, list(c)), *bias)
                d_bias = jax.tree_util.tree_map(
                    lambda a, g: a + g.astype(STATS_DTYPE), d_bias,
                    list(pull(ds.T if tr else ds))
                )
            return (dq, dk, dv, d_bias, d_score), None

        dq, dk, dv, d_bias, d_score = _scan_tiles(st, dyn, body,
                                                  (dq, dk, dv, d_bias, d_score), group)
    if tr:
        dq = dq.T
        d_bias = d_bias.T if st.bias_is_array else d_bias
    d_sink = ()
    if st.has_sink:  # lse is finite on every row (it includes the sink)
        d_sink = -jnp.sum(jnp.exp(sink.astype(STATS_DTYPE) - lse) * delta)
    return dq, dk, dv, (d_bias, d_score, d_sink)


_attend = lse_vjp(_forward, _backward)


def _convert(fn, *examples, differentiable: bool = True):
    """Closure-converts ``fn``: returns ``(converted, float_consts, other_consts)`` where
    ``converted(*args, float_consts, other_consts)`` evaluates ``fn``'s jaxpr, traced at
    ``examples`` (its shapes and dtypes).

    Every array the callable closes over or holds (an ``eqx.Module``'s leaves, possibly tracers
    of an enclosing ``vmap``, ``jit`` or ``grad``) becomes an explicit argument of the custom
    VJP: the floating tracers differentiable (their gradients are accumulated per tile; none
    with ``differentiable=False``), the others passed as data (a concrete array cannot be
    differentiated by any enclosing transformation, so it costs no per-tile gradient).
    ``jax.closure_convert`` would leave non-differentiable tracers inside the function, where
    they would escape the custom VJP.
    """
    closed = jax.make_jaxpr(fn)(*examples)
    consts = [jnp.asarray(c) for c in closed.consts]
    is_float = tuple(differentiable and isinstance(c, jax.core.Tracer)
                     and bool(jnp.issubdtype(c.dtype, jnp.inexact)) for c in closed.consts)

    def converted(*args):
        *xs, float_consts, other_consts = args
        floats, others = iter(float_consts), iter(other_consts)
        merged = [next(floats) if f else next(others) for f in is_float]
        return jax.core.eval_jaxpr(closed.jaxpr, merged, *xs)[0]

    return (converted, [c for c, f in zip(consts, is_float) if f],
            [c for c, f in zip(consts, is_float) if not f])


def _positive_scale(score_mod, block_q: int, block_k: int, floats, others):
    """``(inner, c)`` when ``score_mod``'s last step multiplies by a positive finite constant
    ``c`` (a literal, like Gemma's soft-cap ``c * tanh(s / c)``), so that ``score_mod(s, ...)
    = c * inner(s, ...)`` operation for operation; ``inner`` is converted like ``score_fn``
    (same arguments and captures). None otherwise."""
    scalar = jnp.zeros((), jnp.int32)
    closed = jax.make_jaxpr(score_mod)(jnp.zeros((block_q, block_k), STATS_DTYPE), scalar,
                                       scalar, *_positions(block_q, block_k))
    jaxpr = closed.jaxpr
    if not jaxpr.eqns or len(jaxpr.outvars) != 1:
        return None
    last = jaxpr.eqns[-1]
    if last.primitive is not jax.lax.mul_p or last.outvars[0] is not jaxpr.outvars[0]:
        return None
    literal = [x for x in last.invars if isinstance(x, jax.extend.core.Literal)]
    rest = [x for x in last.invars if not isinstance(x, jax.extend.core.Literal)]
    if len(literal) != 1 or len(rest) != 1 or np.shape(literal[0].val) != ():
        return None
    c = float(literal[0].val)
    if not (math.isfinite(c) and c > 0.0) or rest[0].aval.dtype != STATS_DTYPE:
        return None
    fn, floats_i, others_i = _convert(
        lambda *a: jax.core.eval_jaxpr(jaxpr.replace(eqns=jaxpr.eqns[:-1], outvars=rest),
                                       closed.consts, *a)[0],
        jnp.zeros((block_q, block_k), STATS_DTYPE), scalar, scalar,
        *_positions(block_q, block_k))
    if len(floats_i) != len(floats) or len(others_i) != len(others) or not all(
            a is b for a, b in zip((*floats_i, *others_i), (*floats, *others))):
        return None
    return fn, c


def _positions(block_q: int, block_k: int):
    """Example tile positions ``(q_pos int32[bq, 1], k_pos int32[1, bk])`` to trace at."""
    return jnp.zeros((block_q, 1), jnp.int32), jnp.zeros((1, block_k), jnp.int32)


def convert_flex(score_mod, mask_mod, block_q: int, block_k: int):
    """Flex attention's functions closure-converted at one ``[block_q, block_k]`` tile:
    ``(score_fn, score_floats, score_data, mask_fn, mask_data)``.

    ``score_fn(s, b, h, q_pos, k_pos, score_floats, score_data)`` and ``mask_fn(b, h, q_pos,
    k_pos, [], mask_data)`` evaluate ``score_mod(s, b, h, q_pos, k_pos)`` and ``mask_mod(b, h,
    q_pos, k_pos)`` on ``s f32[bq, bk]``, ``q_pos int32[bq, 1]``, ``k_pos int32[1, bk]``;
    ``score_floats`` are the captured arrays that receive gradients (see :func:`_convert`).
    A function absent gives ``None`` and empty lists. Every tiled kernel (this XLA path and
    the Pallas kernels) evaluates them this way."""
    scalar = jnp.zeros((), jnp.int32)
    score_fn, score_floats, score_data, mask_fn, mask_data = None, [], [], None, []
    if score_mod is not None:
        score_fn, score_floats, score_data = _convert(
            score_mod, jnp.zeros((block_q, block_k), STATS_DTYPE), scalar, scalar,
            *_positions(block_q, block_k))
    if mask_mod is not None:
        mask_fn, _, mask_data = _convert(mask_mod, scalar, scalar,
                                         *_positions(block_q, block_k), differentiable=False)
    return score_fn, score_floats, score_data, mask_fn, mask_data


def _orientation_free(fn) -> bool:
    """Whether the score function ``fn(s, b, h, q_pos, k_pos)`` computes the transpose of its
    result when given the transposed tile (``s^T``, ``q_pos [1, bq]``, ``k_pos [bk, 1]``): as
    every elementwise function does (broadcasting, indexing captured arrays by ``h`` or by
    position), and no function that reduces, slices or reshapes along a tile axis does.

    Decided from the jaxprs of both orientations at a probe tile of 7 x 11 (sides no other
    array is likely to have): equation by equation, the same primitives, and every value of
    the tile's shape transposed (2-D) or of a shape free of the tile's sides. Anything else,
    or a trace that fails, answers False (the tile is turned round instead: always right).
    """
    bq, bk = 7, 11
    scalar = jnp.zeros((), jnp.int32)
    try:
        nat = jax.make_jaxpr(fn)(jnp.zeros((bq, bk), STATS_DTYPE), scalar, scalar,
                                 jnp.zeros((bq, 1), jnp.int32), jnp.zeros((1, bk), jnp.int32))
        tr = jax.make_jaxpr(fn)(jnp.zeros((bk, bq), STATS_DTYPE), scalar, scalar,
                                jnp.zeros((1, bq), jnp.int32), jnp.zeros((bk, 1), jnp.int32))
    except Exception:  # noqa: BLE001  a function that only works at its own orientation
        return False

    def same(a, b) -> bool:
        # The tile's two axes lead (index arrays of jnp's gathers add trailing ones).
        a, b = tuple(a), tuple(b)
        if len(a) < 2:  # a vector along one of the tile's axes has no orientation to swap
            return a == b and not {bq, bk} & set(a)
        if len(a) != len(b) or {bq, bk} & set(a[2:]) or a[2:] != b[2:]:
            return False
        return a[:2] == b[:2][::-1] if {bq, bk} & set(a[:2]) else a == b

    def compare(x, y) -> bool:
        if len(x.eqns) != len(y.eqns):
            return False
        if not all(same(a.aval.shape, b.aval.shape) for a, b in zip(x.outvars, y.outvars)):
            return False
        for e, f in zip(x.eqns, y.eqns):
            if e.primitive.name in ("transpose", "reshape", "rev"):
                return False
            if e.primitive is not f.primitive or len(e.outvars) != len(f.outvars):
                return False
            if not all(same(a.aval.shape, b.aval.shape) for a, b in zip(e.outvars, f.outvars)):
                return False
            subs_e = list(jax.extend.core.jaxprs_in_params(e.params))
            subs_f = list(jax.extend.core.jaxprs_in_params(f.params))
            if len(subs_e) != len(subs_f) or not all(map(compare, subs_e, subs_f)):
                return False
        return True

    out = nat.jaxpr.outvars[0].aval.shape
    if len(out) > 2 or any(n not in (1, m) for n, m in zip(out[::-1], (bk, bq))):
        return False  # not a tile's scores (a transposed tile, say)
    return compare(nat.jaxpr, tr.jaxpr)


def _transposed_score(score_mod, block_q: int, block_k: int, floats, others):
    """``score_mod`` converted at the transposed tile ``[block_k, block_q]`` (see
    ``_Static.score_fn_t``), or None where it is not orientation-free or its captures differ
    from the natural tile's (they are passed once, for both)."""
    if not _orientation_free(score_mod):
        return None
    scalar = jnp.zeros((), jnp.int32)
    fn, floats_t, others_t = _convert(
        score_mod, jnp.zeros((block_k, block_q), STATS_DTYPE), scalar, scalar,
        jnp.zeros((1, block_q), jnp.int32), jnp.zeros((block_k, 1), jnp.int32))
    if len(floats_t) != len(floats) or len(others_t) != len(others) or not all(
            a is b for a, b in zip((*floats_t, *others_t), (*floats, *others))):
        return None
    return fn


def flex_primitives(score_mod, mask_mod, block_q: int = 16, block_k: int = 16) -> frozenset:
    """The names of the JAX primitives flex attention's functions apply (nested jaxprs
    included), traced at one tile: what a compiled kernel must be able to lower (Pallas
    lowers neither ``gather`` nor ``dynamic_slice`` on Triton, so indexing a captured array
    by ``h`` or by position keeps a function on the XLA path there)."""
    names = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    scalar = jnp.zeros((), jnp.int32)
    if score_mod is not None:
        walk(jax.make_jaxpr(score_mod)(jnp.zeros((block_q, block_k), STATS_DTYPE), scalar,
                                       scalar, *_positions(block_q, block_k)).jaxpr)
    if mask_mod is not None:
        walk(jax.make_jaxpr(mask_mod)(scalar, scalar, *_positions(block_q, block_k)).jaxpr)
    return frozenset(names)


def _prepare(q, k, v, layout, *, kv_mask, segments, bias, scale, dropout_rate, key,
             score_mod=None, mask_mod=None, sink=None, index=(0, 0)):
    """Pads checked inputs to whole tiles and gathers the static and dynamic kernel inputs."""
    # Segment ids skip tiles one by one (``_scan_tiles``): a row-gathered group would keep
    # every tile of a row that has one to compute.
    gather = 0 if segments is not None else _gather_width(layout)
    lq_p = layout.num_q_blocks * layout.block_q
    lk_p = layout.num_k_blocks * layout.block_k
    k, v = _tiles.select_real_keys(k, kv_mask), _tiles.select_real_keys(v, kv_mask)
    padded = (pad_to(q, lq_p), pad_to(k, lk_p), pad_to(v, lk_p))
    kv_mask_p = pad_to(kv_mask, lk_p, value=False) if kv_mask is not None else jnp.zeros((0,), bool)
    if segments is not None:
        q_seg, kv_seg = pad_to(segments[0], lq_p, value=-1), pad_to(segments[1], lk_p, value=-2)
    else:
        q_seg = kv_seg = jnp.zeros((0,), jnp.int32)
    seed = _tiles.dropout_seed(key) if dropout_rate > 0.0 else jnp.zeros((2,), jnp.uint32)
    bias_fn, bias_arg, bias_data, bias_is_array = None, (), (), False
    if bias is not None and not callable(bias):
        bias_arg, bias_is_array = pad_to(pad_to(bias, lq_p, 0), lk_p, 1), True
    elif bias is not None:
        bias_fn, bias_arg, bias_data = _convert(
            lambda i, j: bias(i, j), *_positions(layout.block_q, layout.block_k))
    score_fn, score_floats, score_data, mask_fn, mask_data = convert_flex(
        score_mod, mask_mod, layout.block_q, layout.block_k)
    bh = jnp.stack([jnp.asarray(i, jnp.int32) for i in index])
    st = _Static(
        layout=layout,
        scale=float(scale),
        dropout_rate=float(dropout_rate),
        bias_fn=bias_fn,
        bias_is_array=bias_is_array,
        has_kv_mask=kv_mask is not None,
        has_segments=segments is not None,
        scale_folded=bool(q.dtype == STATS_DTYPE or math.frexp(float(scale))[0] == 0.5),
        gather=gather,
        score_fn=score_fn,
        score_fn_t=(_transposed_score(score_mod, layout.block_q, layout.block_k, score_floats,
                                      score_data)
                    if score_fn is not None and _transposed(layout, gather) else None),
        mask_fn=mask_fn,
        has_sink=sink is not None,
        score_scaled=(_positive_scale(score_mod, layout.block_q, layout.block_k, score_floats,
                                      score_data) if score_fn is not None else None),
    )
    masks = _gather_masks(layout) if gather else layout.partial_masks
    dyn = (kv_mask_p, q_seg, kv_seg, seed, jnp.asarray(masks), bias_data,
           (bh, score_data, mask_data))
    extra = (bias_arg, score_floats, () if sink is None else jnp.asarray(sink, STATS_DTYPE))
    return st, padded, extra, dyn


def attend_layout(q, k, v, layout: BlockLayout, *, kv_mask=None, segments=None, bias=None,
                  scale: float, dropout_rate: float = 0.0, key=None, score_mod=None,
                  mask_mod=None, sink=None, index=(0, 0)):
    """Runs the tiled kernel on checked inputs. Returns ``(out [Lq, Dv], lse f32[Lq])``.

    Both outputs are differentiable (a cotangent on ``lse`` is honoured). Inputs are padded to
    whole tiles here; the layout already masks keys past ``lk``.

    Flex attention's pieces (``xformers_jax.attention.flex_attention`` checks them):
    ``score_mod(s f32[bq, bk], b, h, q_pos int32[bq, 1], k_pos int32[1, bk])`` replaces each
    tile's scaled scores, differentiated in the tile (the floating arrays it captures that an
    enclosing transformation traces receive gradients); ``mask_mod(b, h, q_pos, k_pos) ->
    bool`` masks each listed tile as data (the layout's own masks still apply); ``b, h =
    index`` (int32 scalars, possibly traced); ``sink``: a float32 scalar logit added to every
    row's softmax denominator with no value (``lse`` includes it).
    """
    st, (q_p, k_p, v_p), extra, dyn = _prepare(
        q, k, v, layout, kv_mask=kv_mask, segments=segments, bias=bias, scale=scale,
        dropout_rate=dropout_rate, key=key, score_mod=score_mod, mask_mod=mask_mod,
        sink=sink, index=index)
    out, lse = _attend(st, q_p, k_p, v_p, extra, dyn)
    return out[: q.shape[0]].astype(q.dtype), lse[: q.shape[0]]


def attend_layout_backward(q, k, v, layout: BlockLayout, out, lse, d_out, *, kv_mask=None,
                           segments=None, scale: float, d_lse=None):
    """The kernel's backward pass for one key block, given the FINAL ``out`` and ``lse``.

    For callers that split the keys into blocks, run :func:`attend_layout` on each and merge
    the results by their log-sum-exp (ring attention): with the merged ``out [Lq, Dv]``,
    ``lse f32[Lq]`` and the output cotangent ``d_out``, this returns this block's float32
    contributions ``(dq, dk, dv)`` without storing anything per block. No bias or dropout.
    """
    st, (q_p, k_p, v_p), _, dyn = _prepare(
        q, k, v, layout, kv_mask=kv_mask, segments=segments, bias=None, scale=scale,
        dropout_rate=0.0, key=None)
    lq_p = q_p.shape[0]
    lse_p = pad_to(lse.astype(STATS_DTYPE), lq_p, value=-jnp.inf)
    d_lse_p = (jnp.zeros((lq_p,), STATS_DTYPE) if d_lse is None
               else pad_to(d_lse.astype(STATS_DTYPE), lq_p))
    dq, dk, dv, _ = _backward(st, q_p, k_p, v_p, ((), [], ()), dyn, pad_to(out, lq_p), lse_p,
                              pad_to(d_out, lq_p), d_lse_p)
    lq, lk = q.shape[0], k.shape[0]
    return dq[:lq], dk[:lk], dv[:lk]
