"""Hopper (sm_90) flash attention in Mosaic GPU, forward and backward: warpgroup matmuls and
TMA copies.

The Triton kernels of ``_gpu_blocksparse`` issue neither ``wgmma`` nor bulk tensor copies on
Hopper, which held them at 0.39-0.69x cuDNN's fused attention on an H200 (BUILD.md, "On a
GPU"). These kernels are written for the chip in the manner of FlashAttention-3 (Shah et al.,
2024): a CTA of three warpgroups, two computing 64 rows each and one issuing TMA copies of the
streamed tiles into a ring of shared-memory stages, with mbarriers saying when a stage is full
and when both compute warpgroups are done with it. The scores stay in registers (``wgmma``
accumulators), in base 2 with the scale folded in.

- Forward: a CTA holds 128 query rows and streams key and value tiles of 128 rows (two
  stages); a schedule barrier lets one warpgroup's softmax overlap the other's matrix
  products; the online softmax is the kernel layer's (``kernels.online_step``).
- Backward (the recomputing backward of FlashAttention-2/3, ``lse`` and ``delta`` from
  ``kernels.backward_stats``): a dq kernel whose CTA holds 128 query rows (q and dO) and
  streams key and value tiles of 64 rows, computing ``s = q k^T``, ``dp = dO v^T``, ``ds = p
  (dp - delta)`` and ``dq += ds k``; and a dk/dv kernel whose CTA holds 128 key rows and
  streams q, dO, lse and delta tiles of 64 rows, computing the transposed scores and ``dv +=
  p^T dO``, ``dk += ds^T q``. Each CTA writes its rows once: no atomics.

What they share with the other kernels is the plan. For layouts whose tiles are a band ``i -
left <= j <= i + right`` (dense, causal, sliding windows: :func:`whole_band`) the blocks a CTA
visits are a run computed in closed form from the program id (:func:`_walk`; the dk/dv kernel
walks query blocks with the band's sides swapped), in three loops: masked blocks left of the
full run, the full run without a mask, masked blocks to its right. Keys past ``lk`` (and, in
the dk/dv kernel, queries past ``lq``) are masked the same way. Key masks and segment ids
(packed rows) become one int32 code per query row and per key (:func:`_codes`): the row's
codes are held beside its rows, the keys' streamed beside their tiles, and every step masks
where they differ. Flex attention's elementwise score functions (:func:`mosaic_score`) are
applied to each tile, their derivative taken there. Block-sparse layouts whose partial tiles
are a band (random and strided layouts, alone or intersected with causal or sliding-window
masks) run on listed walks instead (:func:`listed_walk`, :func:`listed_walks`: each CTA's
blocks read from a table in global memory, the masked ones first, in all three kernels).
Other layouts and flex calls run the Triton kernels (:func:`forward` and :func:`backward`
fall back).

Testing without a GPU: the CUDA lowering on the CPU checks every layout, and Mosaic GPU's
interpreter (:func:`interpreted`) runs the kernels themselves, their matrix products as dots.

Head dims padded to a multiple of 64 up to 128 (a 128-byte swizzle holds 64 16-bit elements
per row); bf16 and f16 only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from xformers_jax import kernels
from xformers_jax.kernels import STATS_DTYPE

from . import _gpu_blocksparse as _triton

MAX_HEAD_DIM = 128
ROWS_PER_WG = 64  # a warpgroup's wgmma takes 64 query rows
COMPUTE_WGS = 2
BLOCK_Q = ROWS_PER_WG * COMPUTE_WGS
BLOCK_K = 128
STAGES = 2
# The forward runs on its own tiles even where they cover more of a sparse layout than the
# backward's (``_common.FORWARD_AREA_SLACK``): other tiles would take the Triton forward.
FIXED_FORWARD_TILES = True
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_BIG = 1 << 30  # "no bound" for a band side (int32 arithmetic in the kernel)


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


# Mosaic GPU's interpreter (``InterpretGPUParams``: threads, barriers, shared memory and TMA
# copies simulated on the CPU) runs neither ``pl.run_state`` nor ``wgmma`` with an operand in
# registers or a transposed view, and has no layouts. Under :func:`interpreted` the matrix
# products are plain dots of the operands' values and the layout casts are no-ops: what it
# checks is everything around them (the walks, masks, statistics, barriers and copies).
_INTERPRET = []


def _is_ref(x) -> bool:
    from jax._src.state.types import AbstractRef, TransformedRef

    return isinstance(x, TransformedRef) or isinstance(getattr(x, "aval", None), AbstractRef)


def _mma(accs, products, after=None):
    """Warpgroup matrix products: ``accs[n]`` (an f32 array in the WGMMA layout, or a shape
    for a fresh zero accumulator) plus ``a @ b`` (``a @ b^T`` when ``transposed``) for each
    ``(a, b, transposed)`` of ``products[n]``; ``a`` in shared memory or registers, ``b`` in
    shared memory. ``after()`` runs once the products are issued, before they are awaited."""
    plgpu = _plgpu()
    if _INTERPRET:
        outs = []
        for acc, prods in zip(accs, products):
            acc = jnp.zeros(acc, jnp.float32) if isinstance(acc, tuple) else acc
            for x, y, transposed in prods:
                x = x[...] if _is_ref(x) else x
                y = y[...].T if transposed else y[...]
                acc = acc + jnp.dot(x, y, preferred_element_type=jnp.float32)
            outs.append(acc)
        if after is not None:
            after()
        return tuple(outs)

    def issue(refs):
        for ref, prods in zip(refs, products):
            for x, y, transposed in prods:
                plgpu.wgmma(ref, x, plgpu.transpose_ref(y, (1, 0)) if transposed else y)
        if after is not None:
            after()

    if all(isinstance(acc, tuple) for acc in accs):  # fresh: zero-initialised accumulators
        def scoped(*refs):
            issue(refs)
            return tuple(r[...] for r in refs)

        return pl.run_scoped(scoped, *(plgpu.ACC(acc, jnp.float32) for acc in accs))
    return pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc in accs))


def _cast(x, layout):
    """``plgpu.layout_cast`` (a no-op in the interpreter, which has no layouts)."""
    return x if _INTERPRET else _plgpu().layout_cast(x, layout)


def _iota(shape, dim):
    """Positions along ``dim`` of a tile in the WGMMA layout."""
    if _INTERPRET:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    plgpu = _plgpu()
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _load(ref, layout):
    """A vector from shared memory in ``layout`` (a plain load in the interpreter)."""
    return ref[...] if _INTERPRET else _plgpu().load(ref, (), layout=layout)


def interpreted():
    """A context in which the kernels built run in Mosaic GPU's interpreter on the CPU (for
    tests: every warpgroup, barrier and copy simulated; about a minute for a few CTAs). The
    backward kernels run there; the forward's schedule barrier (one warpgroup's softmax
    overlapping the other's products) waits forever in the interpreter (JAX 0.10.2), so the
    forward is checked on a GPU only."""
    import contextlib

    from jax._src.pallas.mosaic_gpu.interpret.params import (
        InterpretGPUParams,
        force_gpu_interpret_mode,
    )

    @contextlib.contextmanager
    def ctx():
        _INTERPRET.append(True)
        try:
            with force_gpu_interpret_mode(InterpretGPUParams()):
                yield
        finally:
            _INTERPRET.pop()

    return ctx()


def _row_layout(plgpu):
    """The layout of one value per accumulator row (renamed across JAX versions)."""
    row = getattr(plgpu.Layout, "WGMMA_ROW", None)
    return row if row is not None else plgpu.Layout.WGMMA.reduce(1)


def head_dim(d: int) -> int:
    return max(64, -(-d // 64) * 64)


def head_dim_problems(dk: int, dv: int) -> list[str]:
    why = [f"head dim {d} > {MAX_HEAD_DIM}" for d in (dk, dv) if d > MAX_HEAD_DIM]
    if dk != dv:
        why.append(f"head dims of q/k ({dk}) and v ({dv}) differ")
    return why


def block_problems(bq: int, bk: int) -> list[str]:
    return _triton.block_problems(bq, bk)


def default_blocks(dk: int, dv: int) -> tuple[int, int]:
    """The backward (Triton) kernels' tiles."""
    return _triton.default_blocks(dk, dv)


def default_forward(dk: int, dv: int, itemsize: int = 2) -> tuple[int, int, int | None]:
    """This forward's tiles: ``(BLOCK_Q, BLOCK_K, STAGES)`` for 16-bit inputs."""
    if itemsize > 2:
        return _triton.default_forward(dk, dv, itemsize)
    return BLOCK_Q, BLOCK_K, STAGES


def device_problems() -> list[str]:
    """Reasons the local GPU cannot run the kernel (it needs sm_90: wgmma, TMA)."""
    dev = jax.devices()[0]
    cap = getattr(dev, "compute_capability", None)
    if dev.platform != "gpu" or cap is None:
        return []  # not a GPU: the platform check names the problem
    if str(cap).split(".")[0] != "9":
        return [f"needs a Hopper GPU (compute capability 9.x), not {cap}"]
    return []


def dtype_problems(dtype) -> list[str]:
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return [f"dtype {jnp.dtype(dtype)} is not bfloat16/float16 (wgmma operands)"]
    return []


@dataclasses.dataclass(frozen=True)
class _Static:
    lq: int  # padded query rows (a multiple of BLOCK_Q)
    lk: int  # real keys
    nk: int  # key blocks
    left: int
    right: int
    d: int
    scale: float
    dtype: str
    codes: bool = False  # key masks or segment ids: per-row and per-key codes, see _codes
    score: Any = None  # flex attention's score function, where it runs here (mosaic_score)
    # A layout that is no band: the key blocks each query block visits (listed_walk)
    listed: tuple[tuple[int, ...], ...] | None = None
    reversed_q: bool = False  # query tiles launched last to first (REVERSED_Q)
    sink: bool = False  # a sink logit (one per sequence and head) in every row's softmax


def _walk(lo, rows: int, left: int, right: int, limit: int, blk: int, n_blocks: int):
    """``(first, n, full_lo, full_n)`` of the blocks of ``blk`` positions on the other side
    that rows ``[lo, lo + rows)`` of a band ``i - left <= j <= i + right`` (``j < limit``)
    visit: the run ``first .. first + n - 1`` and, inside it, the blocks every row sees whole,
    ``full_lo .. full_lo + full_n - 1`` (int32 scalars). The forward and the dq kernel walk
    key blocks from query rows; the dk/dv kernel walks query blocks from key rows with the
    band's sides swapped."""
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    hi = lo + (rows - 1)
    o_lo = jnp.maximum(lo - left, 0)
    o_hi = jnp.minimum(hi + right, limit - 1)
    first = o_lo // blk
    last = jnp.minimum(o_hi // blk, n_blocks - 1)
    n = jnp.maximum(last - first + 1, 0)
    # A block b is full when every row sees all of it: b*blk >= hi - left,
    # (b+1)*blk - 1 <= lo + right and (b+1)*blk <= limit.
    f_lo = jnp.maximum(first, -((-(hi - left)) // blk))
    f_hi = jnp.minimum(jnp.minimum(last, (lo + right + 1) // blk - 1), limit // blk - 1)
    full_n = jnp.maximum(f_hi - f_lo + 1, 0)
    f_lo = jnp.where(full_n > 0, f_lo, last + 1)
    return i32(first), i32(n), i32(f_lo), i32(full_n)


def _ranges(st: _Static, q_lo):
    """The forward's walk: the key blocks (``BLOCK_K``) a CTA with query rows
    ``[q_lo, q_lo + BLOCK_Q)`` visits (:func:`_walk`)."""
    return _walk(q_lo, BLOCK_Q, st.left, st.right, st.lk, BLOCK_K, st.nk)


def _listed(plan, band, along_columns: bool = False):
    """The rows of a listed walk of ``plan``'s tiles: for each query block (each key block
    with ``along_columns``) ``(n, n_masked, x_0, ..., x_{n-1})``, the ``n`` key (query)
    blocks it visits, the first ``n_masked`` to be masked by ``band`` (``i - left <= j <= i +
    right``) and the real lengths, the rest whole; padded to one length. Masked: the partial
    tiles, and whole tiles reaching past the last key (past the last query, along columns),
    whose padding the kernels mask. None when a masked tile's mask is not the band's over its
    real rows and columns."""
    from xformers_jax.kernels import EMPTY, FULL

    bq, bk, lq, lk = plan.block_q, plan.block_k, plan.lq, plan.lk
    kinds = plan.kinds
    past = ((np.arange(plan.nq) + 1) * bq > lq)[:, None] if along_columns else \
        ((np.arange(plan.nk) + 1) * bk > lk)[None, :]
    whole = (kinds == FULL) & ~past
    masked = (kinds != EMPTY) & ~whole
    for a, b in zip(*np.nonzero(masked)):
        r = np.arange(a * bq, min(a * bq + bq, lq))
        c = np.arange(b * bk, min(b * bk + bk, lk))
        if kinds[a, b] == FULL:
            want = np.ones((len(r), len(c)), bool)
        elif plan.band is not None:
            want = _band_mask(r, c, plan.band, lk)
        else:
            want = plan.masks[plan.mask_index[a, b]][: len(r), : len(c)]
        if not np.array_equal(_band_mask(r, c, band, lk), want):
            return None
    if along_columns:
        whole, masked = whole.T, masked.T
    rows = []
    for w, m in zip(whole, masked):
        part, full = np.flatnonzero(m).tolist(), np.flatnonzero(w).tolist()
        rows.append((len(part) + len(full), len(part), *part, *full))
    width = max(len(r) for r in rows)
    return tuple(r + (0,) * (width - len(r)) for r in rows)


def _bands(plan):
    """The bands that may mask a listed walk's tiles: ``Plan.band`` describes the partial
    tiles only (a causal layout's is ``(block - 1, 0)``), and a whole tile masked for its
    padding must lie inside the band too, so each side is tried unbounded first."""
    if plan.band is None:
        return [(_BIG, _BIG)]
    left, right = (min(int(x), _BIG) for x in plan.band)
    return list(dict.fromkeys([(_BIG, _BIG), (_BIG, right), (left, _BIG), (left, right)]))


@functools.lru_cache(maxsize=64)
def listed_walk(plan) -> tuple[tuple[int, int], tuple[tuple[int, ...], ...]] | None:
    """A block-sparse layout's walk for the forward kernel (tiles ``BLOCK_Q x BLOCK_K``):
    ``(band, rows)``, row ``a`` of :func:`_listed` saying which key blocks query block ``a``
    visits, the partial ones (masked by ``band``) first. None when no band is every masked
    tile's mask (the Triton forward runs). Random and strided sparse layouts (all tiles whole
    or empty) and their intersections with causal or sliding-window masks qualify."""
    for band in _bands(plan):
        rows = _listed(plan, band)
        if rows is not None:
            return band, rows
    return None


def _cta_walk(st, walk_ref, cta, band_walk, lo):
    """``(first, n, f_lo, full_n, block)`` of a CTA (any of the three kernels, ``st`` its
    static part): a band's run in closed form (``band_walk(st, lo)``), or row ``cta`` of a
    listed walk (the masked blocks first); ``block(t)`` is the ``t``-th streamed block."""
    if st.listed is None:
        first, n, f_lo, full_n = band_walk(st, lo)
        return first, n, f_lo, full_n, lambda t: first + t
    n, f_lo = walk_ref[cta, 0], walk_ref[cta, 1]
    return 0, n, f_lo, n - f_lo, lambda t: walk_ref[cta, 2 + t]


def ranges_host(st: _Static, q_lo: int) -> tuple[int, int, int, int]:
    """:func:`_ranges` evaluated on the host (tests compare it with the plan's tiles)."""
    return walk_host(_ranges, st, q_lo)


def _kernel_call(st: _Static, n_seq: int):
    plgpu = _plgpu()
    dtype = jnp.dtype(st.dtype)
    d, bk = st.d, BLOCK_K
    row = _row_layout(plgpu)
    scale2 = st.scale * _LOG2E
    num_q_tiles = st.lq // BLOCK_Q

    def body(q_ref, k_ref, v_ref, qc_ref, kc_ref, walk_ref, sink_ref, out_ref, lse_ref, scoped):
        seq = lax.axis_index("seq")
        qt = lax.axis_index("q_tile")
        if st.reversed_q:
            qt = num_q_tiles - 1 - qt
        wg = lax.axis_index("wg")
        (qo_smem2, k_smem, v_smem, lse_smem2, *code_smem), (k_full, v_full, q_full, *code_full), \
            consumed, sched = scoped
        k_used, v_used = consumed
        cta_q0 = qt * BLOCK_Q
        first, n, f_lo, full_n, block = _cta_walk(st, walk_ref, qt, _ranges, cta_q0)

        def schedule():
            if not _INTERPRET:  # the interpreter waits forever on this ping-pong
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(sched)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            lse_smem = lse_smem2.at[wg]
            q0 = cta_q0 + wg * ROWS_PER_WG
            plgpu.copy_gmem_to_smem(q_ref.at[seq, pl.ds(q0, ROWS_PER_WG)], qo_smem,
                                    q_full.at[wg])
            if st.codes:  # this warpgroup's rows' codes
                plgpu.copy_gmem_to_smem(qc_ref.at[seq, pl.ds(q0, ROWS_PER_WG)],
                                        code_smem[0].at[wg], code_full[0].at[wg])
                plgpu.barrier_wait(code_full[0].at[wg])
                q_codes = _load(code_smem[0].at[wg], row)
            plgpu.barrier_wait(q_full.at[wg])
            if st.sink:  # the sink logit (base 2) with weight exp2(0) in every row
                m = _cast(jnp.full((ROWS_PER_WG,), sink_ref[seq, 0, 0] * _LOG2E, jnp.float32),
                          row)
                l = _cast(jnp.full((ROWS_PER_WG,), 1, jnp.float32), row)
            else:
                m = _cast(jnp.full((ROWS_PER_WG,), -jnp.inf, jnp.float32), row)
                l = _cast(jnp.full((ROWS_PER_WG,), 0, jnp.float32), row)
            acc = _cast(jnp.full((ROWS_PER_WG, d), 0, jnp.float32),
                                    plgpu.Layout.WGMMA)

            @pl.when(n > 0)
            def _():
                plgpu.barrier_wait(k_full.at[0])

            pl.when(wg == 1)(schedule)

            def step(t, carry, masked: bool):
                acc, m, l = carry
                slot = lax.rem(t, jnp.int32(STAGES))
                if st.codes:  # read before the slot is released with its keys
                    plgpu.barrier_wait(code_full[1].at[slot])
                    k_codes = _load(code_smem[1].at[slot], _col_layout(plgpu))

                (s,) = _mma(((ROWS_PER_WG, bk),), [[(qo_smem, k_smem.at[slot], True)]],
                            after=schedule)
                plgpu.barrier_arrive(k_used.at[slot])
                if masked or st.score is not None:
                    k0 = block(t) * bk
                    i = q0 + _iota((ROWS_PER_WG, bk), 0)
                    j = k0 + _iota((ROWS_PER_WG, bk), 1)
                if st.score is None:
                    s = s * scale2
                else:  # the score function on the natural scores, then base 2
                    s = st.score(s * st.scale, 0, 0, i, j) * _LOG2E
                if masked:
                    keep = (j >= i - st.left) & (j <= i + st.right) & (j < st.lk)
                    if st.codes:
                        keep &= _same(q_codes, k_codes, s.shape)
                    s = jnp.where(keep, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                shift = m_new
                if masked:  # a row that has seen no key yet keeps m = -inf: shift by 0
                    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2(m - shift)
                p = jnp.exp2(s - lax.broadcast_in_dim(shift, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                if not _INTERPRET:
                    plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_full.at[slot])
                if not _INTERPRET:
                    plgpu.barrier_wait(sched)

                def next_keys():
                    nxt = t + 1

                    @pl.when(nxt < n)
                    def _():
                        plgpu.barrier_wait(k_full.at[lax.rem(nxt, jnp.int32(STAGES))])

                (acc,) = _mma((acc,), [[(p16, v_smem.at[slot], False)]], after=next_keys)
                plgpu.barrier_arrive(v_used.at[slot])
                return acc, m_new, l

            acc, m, l = _loops(first, n, f_lo, full_n, step, (acc, m, l), st.codes)
            pl.when(wg == 0)(schedule)

            seen = l > 0.0
            inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
            acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
            qo_smem[...] = acc.astype(dtype)
            lse_smem[...] = jnp.where(seen, m * _LN2 + jnp.log(jnp.where(seen, l, 1.0)),
                                      -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[seq, pl.ds(q0, ROWS_PER_WG)])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[seq, pl.ds(q0, ROWS_PER_WG)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(t, slot):
                rows = pl.ds(block(t) * bk, bk)
                if st.codes:
                    plgpu.copy_gmem_to_smem(kc_ref.at[seq, rows], code_smem[1].at[slot],
                                            code_full[1].at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[seq, rows], k_smem.at[slot], k_full.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[seq, rows], v_smem.at[slot], v_full.at[slot])

            for t in range(STAGES):
                pl.when(t < n)(functools.partial(fetch, t, t))

            @pl.loop(0, jnp.maximum(n - STAGES, 0))
            def _(t):
                slot = lax.rem(t, jnp.int32(STAGES))
                nxt = t + STAGES
                rows = pl.ds(block(nxt) * bk, bk)
                plgpu.barrier_wait(k_used.at[slot])
                if st.codes:
                    plgpu.copy_gmem_to_smem(kc_ref.at[seq, rows], code_smem[1].at[slot],
                                            code_full[1].at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[seq, rows], k_smem.at[slot], k_full.at[slot])
                plgpu.barrier_wait(v_used.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[seq, rows], v_smem.at[slot], v_full.at[slot])

            if _INTERPRET:  # the interpreter wants every phase of a barrier seen by its waiters
                @pl.loop(jnp.maximum(n - STAGES, 0), n)
                def _(t):
                    slot = lax.rem(t, jnp.int32(STAGES))
                    plgpu.barrier_wait(k_used.at[slot])
                    plgpu.barrier_wait(v_used.at[slot])

    def entry(*refs):
        q_ref, k_ref, v_ref, *codes, out_ref, lse_ref = refs
        walk_ref = codes.pop() if st.listed is not None else None
        sink_ref = codes.pop() if st.sink else None
        qc_ref, kc_ref = codes if st.codes else (None, None)
        transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (
            plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, d), dtype, transforms=transforms),
            plgpu.SMEM((STAGES, bk, d), dtype, transforms=transforms),
            plgpu.SMEM((STAGES, bk, d), dtype, transforms=transforms),
            plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG), jnp.float32),
            *((plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG), jnp.int32),
               plgpu.SMEM((STAGES, bk), jnp.int32)) if st.codes else ()),
        )
        pl.run_scoped(
            lambda *scoped: body(q_ref, k_ref, v_ref, qc_ref, kc_ref, walk_ref, sink_ref, out_ref,
                                 lse_ref, scoped),
            smem,
            (plgpu.Barrier(num_barriers=STAGES), plgpu.Barrier(num_barriers=STAGES),
             plgpu.Barrier(num_barriers=COMPUTE_WGS),
             *((plgpu.Barrier(num_barriers=COMPUTE_WGS), plgpu.Barrier(num_barriers=STAGES))
               if st.codes else ())),
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=STAGES),) * 2,
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((n_seq, st.lq, d), dtype),
                   jax.ShapeDtypeStruct((n_seq, st.lq), jnp.float32)),
        grid=(n_seq, num_q_tiles),
        grid_names=("seq", "q_tile"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )


def _run_nd(st: _Static, q, k, v, *codes):
    """``q, k, v [..., L, D]`` (any leading dims, k/v broadcast to q's) and with
    ``st.codes`` the row and key codes ``[..., L]`` -> ``(out, lse)``."""
    lead = q.shape[:-2]
    n = int(np.prod(lead)) if lead else 1
    flat = lambda x, nd: jnp.broadcast_to(x, (*lead, *x.shape[x.ndim - nd:])).reshape(  # noqa: E731
        n, *x.shape[x.ndim - nd:])
    *codes, sink = codes if st.sink else (*codes, None)
    args = [flat(x, 2) for x in (q, k, v)] + [flat(c, 1) for c in codes]
    if st.sink:
        args.append(flat(sink, 2).astype(jnp.float32))
    if st.listed is not None:
        args.append(jnp.asarray(np.array(st.listed, np.int32)))
    out, lse = _kernel_call(st, n)(*args)
    return out.reshape(*lead, *out.shape[-2:]), lse.reshape(*lead, lse.shape[-1])


def _folded(run, gradients: bool):
    """``run`` (a function of ``[..., L, D]`` inputs) whose ``vmap`` folds the mapped axis into
    the kernels' sequence grid axis (one launch for every batch row and head) instead of a
    loop. With ``gradients`` its outputs are the first three inputs' gradients: an input
    shared across the mapped axis (keys and values of grouped-query heads) gets its gradient
    summed over it."""

    @jax.custom_batching.custom_vmap
    def fn(*args):
        return run(*args)

    @fn.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
                for x, b in zip(args, in_batched)]
        outs = fn(*args)
        if not gradients:
            return outs, (True,) * len(outs)
        outs = tuple(g if b else g.astype(jnp.float32).sum(0).astype(g.dtype)
                     for g, b in zip(outs, in_batched[:3]))
        return outs, tuple(in_batched[:3])

    return fn


@functools.cache
def _batched(st: _Static):
    """The forward kernel over ``[..., L, D]`` inputs, vmaps folded into its grid."""
    return _folded(functools.partial(_run_nd, st), gradients=False)


def forward(cfg, plan, q, k, v, dyn):
    """``(out [Lq_p, D], lse f32 [Lq_p])`` of one sequence and head (padded inputs, the
    forward plan's tiles): a band's walk in closed form, or a block-sparse layout's listed
    walk (:func:`listed_walk`). Other layouts, flex calls :func:`mosaic_flex` refuses, key
    masks and segment ids when ``MOSAIC_MASKS`` is off, and interpret mode (Pallas' own, for
    the Triton kernels) run the Triton forward on the backward's tiles."""
    kv_valid, segs, flex = dyn
    band, listed = whole_band(plan), None
    if band is None and MOSAIC_SPARSE and (plan.block_q, plan.block_k) == (BLOCK_Q, BLOCK_K):
        band, listed = listed_walk(plan) or (None, None)
    masked = kv_valid is not None or segs is not None
    score = mosaic_score(cfg.flex)
    if (cfg.interpret or not mosaic_flex(cfg.flex) or (masked and not MOSAIC_MASKS)
            or band is None or (plan.block_q, plan.block_k) != (BLOCK_Q, BLOCK_K)
            or dtype_problems(q.dtype)):
        return _fallback(cfg, plan, q, k, v, dyn)
    sink = cfg.flex is not None and cfg.flex.has_sink
    st = _Static(lq=q.shape[0], lk=plan.lk, nk=plan.nk, left=band[0], right=band[1],
                 d=q.shape[1], scale=float(cfg.scale), dtype=jnp.dtype(q.dtype).name,
                 codes=masked, score=score, listed=listed, reversed_q=REVERSED_Q in cfg.extra,
                 sink=sink)
    codes = _codes(kv_valid, segs, q.shape[0], k.shape[0]) if masked else ()
    # flex's inputs (_common.flex_inputs): b and h, then the sink f32[1, 1]
    out, lse = _batched(st)(q, k, v, *codes, *([flex[1]] if sink else []))
    return out, lse.astype(STATS_DTYPE)


def _codes(kv_valid, segs, lq: int, lk: int):
    """Key masks and segment ids as one int32 code per query row and per key: a query sees a
    key (inside the band) iff their codes are equal. Keys masked out get -2 (no query has
    it); without segment ids every query has code 0 and every valid key 0."""
    q_code = jnp.zeros((lq,), jnp.int32) if segs is None else segs[0].astype(jnp.int32)
    k_code = jnp.zeros((lk,), jnp.int32) if segs is None else segs[1].astype(jnp.int32)
    if kv_valid is not None:
        k_code = jnp.where(kv_valid != 0, k_code, -2)
    return q_code, k_code


def _scored(st, s, i, j):
    """``(base-2 scores, pull)``: flex attention's score function applied to a tile of
    products ``s`` (query positions ``i``, key positions ``j``, each of the tile's shape), and
    the map taking a cotangent of its natural-unit output back to the raw scores: times the
    function's derivative there, taken in forward mode (the function is elementwise; Mosaic
    GPU lowers no ``add_any``, which reverse mode accumulates with)."""
    raw = s * st.scale
    out, slope = jax.jvp(lambda r: st.score(r, 0, 0, i, j), (raw,), (jnp.ones_like(raw),))
    return out * _LOG2E, lambda ds: ds * slope


def mosaic_flex(flex) -> bool:
    """Whether these kernels run a flex attention call (None: no flex): no mask function, no
    captured array, and a score function :func:`mosaic_score` accepts or none; a sink
    (GPT-OSS's per-head logit) starts every row's softmax."""
    if flex is None:
        return True
    if flex.mask_fn is not None or tuple(flex.counts) != (0, 0, 0):
        return False
    return flex.score_mod is None or mosaic_score(flex) is not None


def mosaic_score(flex):
    """Flex attention's score function when these kernels can apply it in their tiles, else
    None (the call runs the Triton kernels): with no mask function, elementwise
    (``kernels.orientation_free``), capturing no array and reading neither the batch nor the
    head index (these kernels take neither as inputs). Gemma's soft-cap and a bias of
    ``i - j`` qualify; ALiBi's per-head slopes do not."""
    if (flex is None or flex.score_mod is None or flex.mask_fn is not None
            or tuple(flex.counts) != (0, 0, 0)):
        return None
    fn = flex.score_mod
    scalar = jnp.zeros((), jnp.int32)
    try:
        closed = jax.make_jaxpr(fn)(jnp.zeros((8, 16), STATS_DTYPE), scalar, scalar,
                                    jnp.zeros((8, 1), jnp.int32), jnp.zeros((1, 16), jnp.int32))
    except Exception:  # noqa: BLE001  a function that cannot be traced alone
        return None
    jaxpr = closed.jaxpr
    b, h = jaxpr.invars[1], jaxpr.invars[2]
    reads = {id(v) for e in jaxpr.eqns for v in e.invars}
    if closed.consts or {id(b), id(h)} & (reads | {id(v) for v in jaxpr.outvars}):
        return None
    pos = (jnp.zeros((8, 1), jnp.int32), jnp.zeros((1, 16), jnp.int32))
    tangent = jax.make_jaxpr(lambda r: jax.jvp(lambda x: fn(x, 0, 0, *pos), (r,), (r,)))(
        jnp.zeros((8, 16), STATS_DTYPE))
    if any(e.primitive.name == "add_any" for e in tangent.jaxpr.eqns):
        return None  # a derivative Mosaic GPU cannot lower
    return fn if kernels.orientation_free(fn) else None


def _same(row_codes, col_codes, shape):
    """``bool[shape]``: where a row's code (one per row) equals a column's (one per column)."""
    return (lax.broadcast_in_dim(row_codes, shape, [0])
            == lax.broadcast_in_dim(col_codes, shape, [1]))


def _band_mask(rows, cols, band, lk):
    left, right = band
    i, j = rows[:, None], cols[None, :]
    return (j >= i - left) & (j <= i + right) & (j < lk)


@functools.lru_cache(maxsize=256)
def whole_band(plan) -> tuple[int, int] | None:
    """``(left, right)`` such that ``i - left <= j <= i + right`` (and ``j < lk``) is the
    plan's whole mask, every tile's kind included, or None when no band is (then the Triton
    forward runs). ``Plan.band`` describes the partial tiles only (a causal layout's is
    ``(block - 1, 0)``): each of its sides is tried as given and unbounded (``_BIG``)."""
    from xformers_jax.kernels import EMPTY, FULL, PARTIAL

    if plan.band is None and plan.has_partial:
        return None
    sides = [(_BIG, _BIG)] if plan.band is None else [
        (min(int(l), _BIG), min(int(r), _BIG))
        for l in dict.fromkeys((plan.band[0], _BIG)) for r in dict.fromkeys((plan.band[1], _BIG))]
    bq, bk, lq, lk = plan.block_q, plan.block_k, plan.lq, plan.lk
    r0 = np.arange(plan.nq) * bq
    r1 = np.minimum(r0 + bq, lq) - 1  # last real row of each query block
    c0 = np.arange(plan.nk) * bk
    c1 = c0 + bk - 1
    for left, right in sides:
        if left + right < 0:
            continue
        full = ((c0[None, :] >= r1[:, None] - left) & (c1[None, :] <= r0[:, None] + right)
                & (c1[None, :] < lk))
        hit = (np.maximum(r0[:, None] - left, c0[None, :])
               <= np.minimum(np.minimum(r1[:, None] + right, lk - 1), c1[None, :]))
        kinds = np.where(full, FULL, np.where(hit, PARTIAL, EMPTY))
        if not np.array_equal(kinds, plan.kinds):
            continue
        if (left, right) == tuple(min(int(x), _BIG) for x in (plan.band or ())):
            return left, right  # the partial tiles are this band by construction
        ok = True
        for a, b in zip(*np.nonzero(plan.kinds == PARTIAL)):
            rows = np.arange(r0[a], r1[a] + 1)
            cols = np.arange(c0[b], c1[b] + 1)
            want = (_band_mask(rows, cols, plan.band, lk) if plan.band is not None
                    else plan.masks[plan.mask_index[a, b]][: len(rows)])
            if not np.array_equal(_band_mask(rows, cols, (left, right), lk), want):
                ok = False
                break
        if ok:
            return left, right
    return None


def _fallback(cfg, plan, q, k, v, dyn):
    """The Triton forward on the tiles the Triton kernel would pick for this layout
    (``PallasAttention.plans``), the inputs re-padded to them."""
    from ._common import PallasAttention

    triton = PallasAttention("pallas_gpu_blocksparse", "gpu", _triton, interpret=cfg.interpret)
    if cfg.flex is not None and cfg.flex.tile is not None:
        # Flex attention's functions were traced at the backward's tiles: run them there.
        triton = triton.with_options(block_q=cfg.flex.tile[0], block_k=cfg.flex.tile[1])
    _, tri_plan, stages = triton.plans(plan.layout, q.shape[1], v.shape[1], q.dtype,
                                       flex=dyn[2] is not None)
    bq, bk = tri_plan.block_q, tri_plan.block_k
    tri_cfg = dataclasses.replace(cfg, block_q=bq, block_k=bk, num_stages=stages)
    lq, lk = tri_plan.nq * bq, tri_plan.nk * bk
    q_t = kernels.pad_to(q[:lq], lq, 0)
    k_t, v_t = kernels.pad_to(k[:lk], lk, 0), kernels.pad_to(v[:lk], lk, 0)
    kv_valid, segs, flex = dyn
    dyn_t = (None if kv_valid is None else kernels.pad_to(kv_valid[:lk], lk, 0),
             None if segs is None else (kernels.pad_to(segs[0][:lq], lq, 0, -1),
                                        kernels.pad_to(segs[1][:lk], lk, 0, -2)), flex)
    out, lse = _triton.forward(tri_cfg, tri_plan, q_t, k_t, v_t, dyn_t)
    return (kernels.pad_to(out[: q.shape[0]], q.shape[0], 0),
            kernels.pad_to(lse[: q.shape[0]], q.shape[0], 0, -jnp.inf))


# The backward (FlashAttention-3's structure again): a dq kernel whose CTA holds 2 x 64 query
# rows and streams key/value blocks of ``BWD_BLOCK``, and a dk/dv kernel whose CTA holds 2 x 64
# key rows and streams query, dO and (lse, delta) blocks of ``BWD_BLOCK``. 64-row streamed
# blocks keep two f32 tiles of scores (s and dp) beside one or two f32 accumulators of head dim
# 128 in a compute warpgroup's registers.
BWD_BLOCK = 64
BWD_HELD = ROWS_PER_WG * COMPUTE_WGS  # rows a backward CTA holds: 128
BWD_STAGES = 2
# The Triton backward kernels after this forward instead: for a kernel object, the option
# ``with_options(extra=(TRITON_BACKWARD,))`` (the gpu_attention suite's comparison); for every
# call, XFORMERS_JAX_MOSAIC_BACKWARD=0 in the environment.
TRITON_BACKWARD = "triton_backward"
# Query tiles launched last to first in the forward and dq kernels (``extra=(REVERSED_Q,)``):
# a causal layout's heaviest tiles first, so that the grid's last wave holds its lightest
# (FlashAttention-2's ordering; a kernel option until a GPU run measures it).
REVERSED_Q = "reversed_q_tiles"
# Other streamed tiles for the backward (to measure them): the kernel option
# ``extra=(("bwd_tiles", block, stages),)``, block 64 or 128 rows, 2 or 3 stages.
BWD_TILES = "bwd_tiles"
# Flex attention: score functions that ``mosaic_score`` accepts run in these kernels' tiles,
# traced at their own tiles; every other flex call runs the Triton kernels.
FLEX = True
FLEX_OWN_TILES = True
FLEX_UNLOWERED = _triton.FLEX_UNLOWERED
# Key masks and segment ids (packed rows) in the Mosaic kernels (``_codes``); 0: the Triton
# kernels take those calls.
MOSAIC_MASKS = os.environ.get("XFORMERS_JAX_MOSAIC_MASKS", "1") != "0"
MOSAIC_BACKWARD = os.environ.get("XFORMERS_JAX_MOSAIC_BACKWARD", "1") != "0"
MOSAIC_SPARSE = os.environ.get("XFORMERS_JAX_MOSAIC_SPARSE", "1") != "0"


@dataclasses.dataclass(frozen=True)
class _BwdStatic:
    lq: int  # padded query rows (a multiple of BWD_HELD)
    lk: int  # padded keys (a multiple of BWD_HELD)
    lq_real: int
    lk_real: int
    left: int
    right: int
    d: int
    scale: float
    dtype: str
    block: int = BWD_BLOCK  # rows of each streamed tile
    stages: int = BWD_STAGES  # shared-memory ring depth
    codes: bool = False  # key masks or segment ids (``_codes``)
    score: Any = None  # flex attention's score function (mosaic_score)
    # A layout that is no band: the dq and the dk/dv kernels' walks (listed_walks)
    listed: tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] | None = None
    reversed_q: bool = False  # the dq kernel's query tiles launched last to first (REVERSED_Q)


@functools.lru_cache(maxsize=64)
def listed_walks(layout, block: int):
    """``(band, dq_rows, dkv_rows)`` for a block-sparse layout's backward with streamed tiles
    of ``block`` rows: a band that masks the forward's and both backward kernels' masked
    tiles, the key blocks each dq CTA (``BWD_HELD`` query rows) visits and the query blocks
    each dk/dv CTA (``BWD_HELD`` keys) visits (:func:`_listed`); None where there is none."""
    fwd = kernels.plan(layout, BLOCK_Q, BLOCK_K)
    if listed_walk(fwd) is None:
        return None
    for band in _bands(fwd):  # one band for the forward and both backward kernels
        walks = (_listed(fwd, band), _listed(kernels.plan(layout, BWD_HELD, block), band),
                 _listed(kernels.plan(layout, block, BWD_HELD), band, along_columns=True))
        if None not in walks:
            return band, walks[1], walks[2]
    return None


def dq_walk(st: _BwdStatic, q_lo):
    """The key blocks a dq CTA with query rows ``[q_lo, q_lo + 128)`` visits."""
    return _walk(q_lo, BWD_HELD, st.left, st.right, st.lk_real, st.block, st.lk // st.block)


def dkv_walk(st: _BwdStatic, k_lo):
    """The query blocks a dk/dv CTA with key rows ``[k_lo, k_lo + 128)`` visits: query ``i``
    sees key ``j`` when ``j - right <= i <= j + left`` (the band's sides swapped)."""
    return _walk(k_lo, BWD_HELD, st.right, st.left, st.lq_real, st.block, st.lq // st.block)


def walk_host(fn, st, lo: int) -> tuple[int, int, int, int]:
    """A walk (``_ranges``, :func:`dq_walk`, :func:`dkv_walk`) evaluated on the host."""
    return tuple(int(x) for x in fn(st, jnp.int32(lo)))


def _col_layout(plgpu):
    """The layout of one value per accumulator column (renamed across JAX versions)."""
    col = getattr(plgpu.Layout, "WGMMA_COL", None)
    return col if col is not None else plgpu.Layout.WGMMA.reduce(0)


def _smem_tiles(plgpu, shape, dtype):
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                                plgpu.SwizzleTransform(128)))


def _zeros(plgpu, shape):
    return _cast(jnp.full(shape, 0, jnp.float32), plgpu.Layout.WGMMA)


def _loops(first, n, f_lo, full_n, step, carry, all_masked: bool = False):
    """Masked steps before the full run, the full run unmasked, masked steps after it (every
    step masked with ``all_masked``: key masks or segment ids)."""
    if all_masked:
        return lax.fori_loop(0, n, functools.partial(step, masked=True), carry)
    n_left = f_lo - first
    carry = lax.fori_loop(0, n_left, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(n_left, n_left + full_n, functools.partial(step, masked=False), carry)
    return lax.fori_loop(n_left + full_n, n, functools.partial(step, masked=True), carry)


def _stream(plgpu, n, stages, used, copies):
    """The memory warpgroup's loop: step ``t``'s copies (``copies(t)``) into a ring of
    ``stages`` slots, each slot refilled once both compute warpgroups released it (``used``)."""
    def fill(t, slot):
        for src, dst, full in copies(t):
            plgpu.copy_gmem_to_smem(src, dst.at[slot], full.at[slot])

    for t in range(stages):
        pl.when(t < n)(functools.partial(fill, t, t))

    @pl.loop(0, jnp.maximum(n - stages, 0))
    def _(t):
        slot = lax.rem(t, jnp.int32(stages))
        plgpu.barrier_wait(used.at[slot])
        fill(t + stages, slot)

    if _INTERPRET:  # the interpreter wants every phase of a barrier seen by its waiters
        @pl.loop(jnp.maximum(n - stages, 0), n)
        def _(t):
            plgpu.barrier_wait(used.at[lax.rem(t, jnp.int32(stages))])


def _dq_call(st: _BwdStatic, n_seq: int):
    plgpu = _plgpu()
    dtype = jnp.dtype(st.dtype)
    d, bk, rows = st.d, st.block, ROWS_PER_WG
    row = _row_layout(plgpu)
    scale2 = st.scale * _LOG2E

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qc_ref, kc_ref, walk_ref, dq_ref,
             scoped):
        seq = lax.axis_index("seq")
        wg = lax.axis_index("wg")
        (q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem, *code_smem), \
            (held, k_full, v_full, *code_full), used = scoped
        qt = lax.axis_index("q_tile")
        if st.reversed_q:
            qt = st.lq // BWD_HELD - 1 - qt
        cta_q0 = qt * BWD_HELD
        first, n, f_lo, full_n, block = _cta_walk(st, walk_ref, qt, dq_walk, cta_q0)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            lse_smem, delta_smem = lse_smem2.at[wg], delta_smem2.at[wg]
            q0 = cta_q0 + wg * rows
            mine = pl.ds(q0, rows)
            held_refs = ((q_ref, q_smem), (do_ref, do_smem), (lse_ref, lse_smem),
                         (delta_ref, delta_smem))
            if st.codes:
                held_refs += ((qc_ref, code_smem[0].at[wg]),)
            for n_ref, (src, dst) in enumerate(held_refs):
                plgpu.copy_gmem_to_smem(src.at[seq, mine], dst, held.at[n_ref * COMPUTE_WGS + wg])
            for n_ref in range(len(held_refs)):
                plgpu.barrier_wait(held.at[n_ref * COMPUTE_WGS + wg])
            lse2 = _load(lse_smem, row) * _LOG2E
            delta = _load(delta_smem, row)
            q_codes = _load(code_smem[0].at[wg], row) if st.codes else None

            def step(t, dq, masked: bool):
                slot = lax.rem(t, jnp.int32(st.stages))
                plgpu.barrier_wait(k_full.at[slot])
                plgpu.barrier_wait(v_full.at[slot])
                if st.codes:
                    plgpu.barrier_wait(code_full[0].at[slot])
                    k_codes = _load(code_smem[1].at[slot], _col_layout(plgpu))

                s, dp = _mma((_zeros(plgpu, (rows, bk)), _zeros(plgpu, (rows, bk))),
                             [[(q_smem, k_smem.at[slot], True)],
                              [(do_smem, v_smem.at[slot], True)]])
                if masked or st.score is not None:
                    k0 = block(t) * bk
                    i = q0 + _iota((rows, bk), 0)
                    j = k0 + _iota((rows, bk), 1)
                s, raw_grad = _scored(st, s, i, j) if st.score is not None else (s * scale2, None)
                if masked:
                    keep = (j >= i - st.left) & (j <= i + st.right) & (j < st.lk_real)
                    if st.codes:
                        keep &= _same(q_codes, k_codes, s.shape)
                    s = jnp.where(keep, s, -jnp.inf)
                # lse is +inf on rows that saw nothing (``backward_stats``): p = 0 there.
                p = jnp.exp2(s - lax.broadcast_in_dim(lse2, s.shape, [0]))
                ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))
                if raw_grad is not None:  # back through the score function, at the raw scores
                    ds = raw_grad(ds)

                (dq,) = _mma((dq,), [[(ds.astype(dtype), k_smem.at[slot], False)]])
                plgpu.barrier_arrive(used.at[slot])
                return dq

            dq = _loops(first, n, f_lo, full_n, step, _zeros(plgpu, (rows, d)), st.codes)
            q_smem[...] = (dq * st.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[seq, pl.ds(q0, rows)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def copies(t):
                blk = pl.ds(block(t) * bk, bk)
                out = ((k_ref.at[seq, blk], k_smem, k_full), (v_ref.at[seq, blk], v_smem, v_full))
                if st.codes:
                    out += ((kc_ref.at[seq, blk], code_smem[1], code_full[0]),)
                return out

            _stream(plgpu, n, st.stages, used, copies)

    def entry(*refs):
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *codes, dq_ref = refs
        walk_ref = codes[-2] if st.listed is not None else None  # (dq walk, dk/dv walk)
        codes = codes[:-2] if st.listed is not None else codes
        qc_ref, kc_ref = codes if st.codes else (None, None)
        smem = (_smem_tiles(plgpu, (COMPUTE_WGS, rows, d), dtype),
                _smem_tiles(plgpu, (COMPUTE_WGS, rows, d), dtype),
                plgpu.SMEM((COMPUTE_WGS, rows), jnp.float32),
                plgpu.SMEM((COMPUTE_WGS, rows), jnp.float32),
                _smem_tiles(plgpu, (st.stages, bk, d), dtype),
                _smem_tiles(plgpu, (st.stages, bk, d), dtype),
                *((plgpu.SMEM((COMPUTE_WGS, rows), jnp.int32),
                   plgpu.SMEM((st.stages, bk), jnp.int32)) if st.codes else ()))
        held = (5 if st.codes else 4) * COMPUTE_WGS
        pl.run_scoped(
            lambda *scoped: body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qc_ref, kc_ref,
                                 walk_ref, dq_ref, scoped),
            smem,
            (plgpu.Barrier(num_barriers=held), plgpu.Barrier(num_barriers=st.stages),
             plgpu.Barrier(num_barriers=st.stages),
             *((plgpu.Barrier(num_barriers=st.stages),) if st.codes else ())),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=st.stages),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((n_seq, st.lq, d), dtype),
        grid=(n_seq, st.lq // BWD_HELD),
        grid_names=("seq", "q_tile"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )


def _dkv_call(st: _BwdStatic, n_seq: int):
    plgpu = _plgpu()
    dtype = jnp.dtype(st.dtype)
    d, bq, rows = st.d, st.block, ROWS_PER_WG
    col = _col_layout(plgpu)
    scale2 = st.scale * _LOG2E

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qc_ref, kc_ref, walk_ref, dk_ref,
             dv_ref, scoped):
        seq = lax.axis_index("seq")
        wg = lax.axis_index("wg")
        (k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem, *code_smem), (held, *fulls), \
            used = scoped
        cta_k0 = lax.axis_index("k_tile") * BWD_HELD
        first, n, f_lo, full_n, block = _cta_walk(st, walk_ref, lax.axis_index("k_tile"),
                                                  dkv_walk, cta_k0)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            k0 = cta_k0 + wg * rows
            mine = pl.ds(k0, rows)
            plgpu.copy_gmem_to_smem(k_ref.at[seq, mine], k_smem, held.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[seq, mine], v_smem, held.at[COMPUTE_WGS + wg])
            if st.codes:  # this warpgroup's keys' codes
                plgpu.copy_gmem_to_smem(kc_ref.at[seq, mine], code_smem[0].at[wg],
                                        held.at[2 * COMPUTE_WGS + wg])
                plgpu.barrier_wait(held.at[2 * COMPUTE_WGS + wg])
                k_codes = _load(code_smem[0].at[wg], _row_layout(plgpu))
            plgpu.barrier_wait(held.at[wg])
            plgpu.barrier_wait(held.at[COMPUTE_WGS + wg])

            def step(t, carry, masked: bool):
                dk, dv = carry
                slot = lax.rem(t, jnp.int32(st.stages))
                for full in fulls:
                    plgpu.barrier_wait(full.at[slot])

                # Transposed: a row per key, a column per query.
                s, dp = _mma((_zeros(plgpu, (rows, bq)), _zeros(plgpu, (rows, bq))),
                             [[(k_smem, q_smem.at[slot], True)],
                              [(v_smem, do_smem.at[slot], True)]])
                lse2 = _load(lse_smem.at[slot], col) * _LOG2E
                delta = _load(delta_smem.at[slot], col)
                if masked or st.score is not None:
                    q0 = block(t) * bq
                    j = k0 + _iota((rows, bq), 0)
                    i = q0 + _iota((rows, bq), 1)
                s, raw_grad = _scored(st, s, i, j) if st.score is not None else (s * scale2, None)
                if masked:
                    keep = (j >= i - st.left) & (j <= i + st.right) & (i < st.lq_real)
                    if st.codes:
                        keep &= _same(k_codes, _load(code_smem[1].at[slot], col), s.shape)
                    s = jnp.where(keep, s, -jnp.inf)
                p = jnp.exp2(s - lax.broadcast_in_dim(lse2, s.shape, [1]))
                ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [1]))
                if raw_grad is not None:
                    ds = raw_grad(ds)

                dk, dv = _mma((dk, dv), [[(ds.astype(dtype), q_smem.at[slot], False)],
                                         [(p.astype(dtype), do_smem.at[slot], False)]])
                plgpu.barrier_arrive(used.at[slot])
                return dk, dv

            dk, dv = _loops(first, n, f_lo, full_n, step,
                            (_zeros(plgpu, (rows, d)), _zeros(plgpu, (rows, d))), st.codes)
            k_smem[...] = (dk * st.scale).astype(dtype)
            v_smem[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[seq, mine])
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[seq, mine])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def copies(t):
                blk = pl.ds(block(t) * bq, bq)
                srcs = ((q_ref, q_smem), (do_ref, do_smem), (lse_ref, lse_smem),
                        (delta_ref, delta_smem))
                if st.codes:
                    srcs += ((qc_ref, code_smem[1]),)
                return tuple((src.at[seq, blk], dst, full)
                             for (src, dst), full in zip(srcs, fulls))

            _stream(plgpu, n, st.stages, used, copies)

    def entry(*refs):
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *codes, dk_ref, dv_ref = refs
        walk_ref = codes[-1] if st.listed is not None else None  # (dq walk, dk/dv walk)
        codes = codes[:-2] if st.listed is not None else codes
        qc_ref, kc_ref = codes if st.codes else (None, None)
        smem = (_smem_tiles(plgpu, (COMPUTE_WGS, rows, d), dtype),
                _smem_tiles(plgpu, (COMPUTE_WGS, rows, d), dtype),
                _smem_tiles(plgpu, (st.stages, bq, d), dtype),
                _smem_tiles(plgpu, (st.stages, bq, d), dtype),
                plgpu.SMEM((st.stages, bq), jnp.float32),
                plgpu.SMEM((st.stages, bq), jnp.float32),
                *((plgpu.SMEM((COMPUTE_WGS, rows), jnp.int32),
                   plgpu.SMEM((st.stages, bq), jnp.int32)) if st.codes else ()))
        pl.run_scoped(
            lambda *scoped: body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qc_ref, kc_ref,
                                 walk_ref, dk_ref, dv_ref, scoped),
            smem,
            (plgpu.Barrier(num_barriers=(3 if st.codes else 2) * COMPUTE_WGS),
             *(plgpu.Barrier(num_barriers=st.stages),) * (5 if st.codes else 4)),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=st.stages),
            collective_axes="wg",
        )

    kv = jax.ShapeDtypeStruct((n_seq, st.lk, d), dtype)
    return plgpu.kernel(
        entry,
        out_type=(kv, kv),
        grid=(n_seq, st.lk // BWD_HELD),
        grid_names=("seq", "k_tile"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )


def _run_bwd_nd(st: _BwdStatic, q, k, v, d_out, lse, delta, *codes):
    """``[..., L, D]`` inputs with equal leading dims (and ``[..., L]`` statistics and codes)
    -> ``(dq, dk, dv)``."""
    lead = q.shape[:-2]
    n = int(np.prod(lead)) if lead else 1
    flat = lambda x, nd: x.reshape(n, *x.shape[len(x.shape) - nd:])  # noqa: E731
    args = [flat(x, 2) for x in (q, k, v, d_out)] + [flat(x, 1) for x in (lse, delta, *codes)]
    if st.listed is not None:
        args += [jnp.asarray(np.array(rows, np.int32)) for rows in st.listed]
    dq = _dq_call(st, n)(*args)
    dk, dv = _dkv_call(st, n)(*args)
    return tuple(x.reshape(*lead, *x.shape[-2:]) for x in (dq, dk, dv))


@functools.cache
def _batched_bwd(st: _BwdStatic):
    """The backward kernels over ``[..., L, D]`` inputs, vmaps folded into their grids."""
    return _folded(functools.partial(_run_bwd_nd, st), gradients=True)


def backward(cfg, plan, q, k, v, dyn, lse, delta, d_out):
    """``(dq, dk, dv, [])``: the Mosaic GPU dq and dk/dv kernels for 16-bit inputs on a band
    or a block-sparse layout's listed walks (:func:`listed_walks`), with the flex calls
    :func:`mosaic_flex` accepts (a sink needs only the log-sum-exp here) and key masks and
    segment ids as codes; else the Triton backward kernels (``_gpu_blocksparse.backward``)
    on the backward plan."""
    kv_valid, segs, flex = dyn
    tiles = [x[1:] for x in cfg.extra if isinstance(x, tuple) and x[:1] == (BWD_TILES,)]
    block, stages = tiles[-1] if tiles else (BWD_BLOCK, BWD_STAGES)
    band, listed = whole_band(plan), None
    if band is None and MOSAIC_SPARSE:
        band, *listed = listed_walks(plan.layout, block) or (None,)
    masked = kv_valid is not None or segs is not None
    score = mosaic_score(cfg.flex)
    if (cfg.interpret or not MOSAIC_BACKWARD or TRITON_BACKWARD in cfg.extra
            or (masked and not MOSAIC_MASKS) or not mosaic_flex(cfg.flex)
            or band is None or dtype_problems(q.dtype) or q.shape[1] != v.shape[1]):
        return _triton.backward(cfg, plan, q, k, v, dyn, lse, delta, d_out)
    lq, lk = q.shape[0], k.shape[0]
    lq_p, lk_p = (-(-x // BWD_HELD) * BWD_HELD for x in (lq, lk))
    if listed and (len(listed[0]), len(listed[1])) != (lq_p // BWD_HELD, lk_p // BWD_HELD):
        return _triton.backward(cfg, plan, q, k, v, dyn, lse, delta, d_out)
    st = _BwdStatic(lq=lq_p, lk=lk_p, lq_real=min(plan.lq, lq), lk_real=min(plan.lk, lk),
                    left=band[0], right=band[1], d=q.shape[1], scale=float(cfg.scale),
                    dtype=jnp.dtype(q.dtype).name, block=block, stages=stages, codes=masked,
                    score=score, listed=tuple(listed) if listed else None,
                    reversed_q=REVERSED_Q in cfg.extra)
    pad = lambda x, n, value=0: kernels.pad_to(x, n, 0, value)  # noqa: E731
    codes = ()
    if masked:
        q_code, k_code = _codes(kv_valid, segs, lq, lk)
        codes = (pad(q_code, lq_p, -1), pad(k_code, lk_p, -2))
    dq, dk, dv = _batched_bwd(st)(
        pad(q, lq_p), pad(k, lk_p), pad(v, lk_p), pad(d_out.astype(q.dtype), lq_p),
        pad(lse.astype(jnp.float32), lq_p, jnp.inf), pad(delta.astype(jnp.float32), lq_p),
        *codes)
    return dq[:lq], dk[:lk], dv[:lk], []
