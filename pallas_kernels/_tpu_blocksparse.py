"""TPU (Mosaic) kernels: block-sparse flash attention, forward and backward.

As on GPU, flash attention is the plan of the full or causal layout (causal masks evaluated
from positions), so one set of kernels serves both ops. The grid is ``(row, step)``: ``row``
is a query block (forward, dq) or key block (dk, dv) and is "parallel"; ``step`` walks the
row's listed blocks and is "arbitrary" (sequential, accumulating into VMEM scratch). The plan
tables are scalar-prefetched into SMEM and drive the BlockSpec index maps, so the pipeline
DMAs exactly the listed blocks; steps past a row's count repeat the last block index (no new
copy) and skip their compute.

TPU tiling rules honoured here: the last two dims of every block are multiples of (8, 128) or
the whole array dim. Tiles are ``block_q % 16 == 0`` (bf16 packs 16 rows per vreg) and
``block_k % 128 == 0`` (the key axis is the lane axis of score, mask and key-side id tiles).
Per-row statistics and query segment ids are stored lane-broadcast as ``[L, 128]`` and
key-side vectors sublane-broadcast as ``[8, L]``, the layouts Mosaic loads without relayout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from xformers_jax.kernels import STATS_DTYPE

from . import _common as C

LANES, SUBLANES = 128, 8
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128

# Flex attention's score and mask functions run in these kernels' tiles (``_common.FlexTile``):
# ``b, h`` and the sink are read from scalar memory, captured arrays are whole VMEM blocks.
FLEX = True
# Indexing a captured array by ``h`` or position (ALiBi's slopes, a bias table, document ids)
# could not be lowered for Mosaic on a CPU host (the lowering asks for the TPU's generation),
# so it is unverified: such functions run on the XLA path until checked on a TPU.
FLEX_UNLOWERED = ("gather", "dynamic_slice", "scatter", "scatter-add", "dynamic_update_slice")


def default_blocks(dk: int, dv: int) -> tuple[int, int]:
    """The default tiles (not yet measured on a TPU: the same for every head dim)."""
    del dk, dv
    return DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K


def default_forward(dk: int, dv: int, itemsize: int = 2) -> tuple[int, int, None]:
    """The forward kernel's default ``(block_q, block_k, num_stages)``: the backward's tiles."""
    del itemsize
    return (*default_blocks(dk, dv), None)


def head_dim(d: int) -> int:
    return d  # a block spanning the whole head dim is always a legal TPU block


def head_dim_problems(dk: int, dv: int) -> list[str]:
    return []


def block_problems(bq: int, bk: int) -> list[str]:
    why = []
    if bq % 16:
        why.append(f"block_q={bq} is not a multiple of 16 (TPU sublane tiling)")
    if bk % LANES:
        why.append(f"block_k={bk} is not a multiple of {LANES} (TPU lane tiling)")
    return why


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def _lanes(x):
    return jnp.broadcast_to(x, (x.shape[0], LANES))


class _Side:
    """The optional inputs (partial masks, kv mask, segment ids) of one kernel.

    ``row_is_q`` says whether the grid row is a query block (forward, dq) or a key block.
    """

    def __init__(self, cfg, plan, row_is_q):
        self.cfg, self.plan, self.row_is_q = cfg, plan, row_is_q
        self.width = (plan.rows if row_is_q else plan.cols).width

    def arrays_and_specs(self, dyn):
        """Inputs and BlockSpecs; index maps get ``(row, step, blocks, fetch_ids, ...)``."""
        cfg, plan, w = self.cfg, self.plan, self.width
        bq, bk = plan.block_q, plan.block_k
        kv_valid, segs, _ = dyn
        q_idx = (lambda r, t, b, *_: r) if self.row_is_q else (lambda r, t, b, *_: b[r * w + t])
        k_idx = (lambda r, t, b, *_: b[r * w + t]) if self.row_is_q else (lambda r, t, b, *_: r)
        arrays, specs = [], []
        if plan.masks.size:
            arrays.append(C.masks_array(plan))
            specs.append(pl.BlockSpec((None, bq, bk), lambda r, t, b, f, *_: (f[r * w + t], 0, 0)))
        key_side = []
        if cfg.has_kv_mask:
            key_side.append(kv_valid)
        if cfg.has_segments:
            arrays.append(jnp.broadcast_to(segs[0][:, None], (segs[0].shape[0], LANES)))
            specs.append(pl.BlockSpec((bq, LANES), lambda *a: (q_idx(*a), 0)))
            key_side.append(segs[1])
        for x in key_side:
            arrays.append(jnp.broadcast_to(x[None, :], (SUBLANES, x.shape[0])))
            specs.append(pl.BlockSpec((SUBLANES, bk), lambda *a: (0, k_idx(*a))))
        if cfg.flex is not None:
            flex = list(dyn[2])
            n_scalar = 1 + int(cfg.flex.has_sink)  # b, h and the sink
            arrays += flex
            specs += [pl.BlockSpec(memory_space=pltpu.SMEM) for _ in flex[:n_scalar]]
            specs += [pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n)
                      for x in flex[n_scalar:]]
        return arrays, specs, q_idx, k_idx

    def unpack(self, refs):
        refs = list(refs)
        self.mask_ref = refs.pop(0) if self.plan.masks.size else None
        self.q_seg_ref = refs.pop(0) if self.cfg.has_segments else None
        self.kv_valid_ref = refs.pop(0) if self.cfg.has_kv_mask else None
        self.k_seg_ref = refs.pop(0) if self.cfg.has_segments else None
        self.fx = None
        if self.cfg.flex is not None:
            n = self.cfg.flex.num_inputs
            self.fx, refs = C.FlexTile(self.cfg.flex, refs[:n]), refs[n:]
        return refs

    def scores(self, q, k, mask, q0, k0):
        """``(s, raw, mask)`` of the tile (``_common.tile_scores``)."""
        return C.tile_scores(self.cfg, q, k, mask, self.fx, q0, k0)

    def mask(self, q0, k0, partial):
        static = None
        if partial and self.mask_ref is not None:
            static = self.mask_ref[...] != 0
        kv_valid = None if self.kv_valid_ref is None else self.kv_valid_ref[0:1, :] != 0
        q_seg = None if self.q_seg_ref is None else self.q_seg_ref[:, 0:1]
        k_seg = None if self.k_seg_ref is None else self.k_seg_ref[0:1, :]
        return C.tile_mask(self.plan, q0, k0, partial=partial, static_mask=static,
                           kv_valid=kv_valid, q_seg=q_seg, k_seg=k_seg)


def _steps(blocks_ref, counts_ref, full_ref, width, run):
    """Runs ``run(row, listed_block, partial)`` at this grid step if the row lists one."""
    r, t = pl.program_id(0), pl.program_id(1)
    n_full, n = full_ref[r], counts_ref[r]
    b = blocks_ref[r * width + t]
    pl.when(t < n_full)(lambda: run(r, b, False))
    pl.when((t >= n_full) & (t < n))(lambda: run(r, b, True))


def _fwd_kernel(blocks_ref, fids_ref, counts_ref, full_ref, q_ref, k_ref, v_ref, *refs, side):
    o_ref, lse_ref, m_scr, l_scr, acc_scr = side.unpack(refs)
    plan = side.plan
    t = pl.program_id(1)

    @pl.when(t == 0)
    def _():
        if side.fx is not None:  # the sink logit, if any, starts every row
            m0, l0 = side.fx.initial_stats(m_scr.shape[0])
            m_scr[...], l_scr[...] = _lanes(m0), _lanes(l0)
        else:
            m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, STATS_DTYPE)
            l_scr[...] = jnp.zeros(l_scr.shape, STATS_DTYPE)
        acc_scr[...] = jnp.zeros(acc_scr.shape, STATS_DTYPE)

    def run(i, kb, partial):
        q0, k0 = i * plan.block_q, kb * plan.block_k
        s, _, _ = side.scores(q_ref[...], k_ref[...], side.mask(q0, k0, partial), q0, k0)
        m, l, acc = C.online_step(s, v_ref[...], m_scr[:, 0:1], l_scr[:, 0:1], acc_scr[...])
        m_scr[...], l_scr[...], acc_scr[...] = _lanes(m), _lanes(l), acc

    _steps(blocks_ref, counts_ref, full_ref, side.width, run)

    @pl.when(t == side.width - 1)
    def _():
        out, lse = C.finish(m_scr[:, 0:1], l_scr[:, 0:1], acc_scr[...])
        o_ref[...] = out.astype(o_ref.dtype)
        lse_ref[...] = _lanes(lse)


def _dq_kernel(blocks_ref, fids_ref, counts_ref, full_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
               delta_ref, *refs, side):
    # Flex: each capture's cotangent, this query block's share, accumulated in its output
    # block (resident while the row's steps run).
    dq_ref, *d_capture_refs, dq_scr = side.unpack(refs)
    plan = side.plan
    t = pl.program_id(1)

    @pl.when(t == 0)
    def _():
        dq_scr[...] = jnp.zeros(dq_scr.shape, STATS_DTYPE)
        for ref in d_capture_refs:
            ref[...] = jnp.zeros(ref.shape, ref.dtype)

    def run(i, kb, partial):
        q0, k0 = i * plan.block_q, kb * plan.block_k
        q, k = q_ref[...], k_ref[...]
        s, raw, mask = side.scores(q, k, side.mask(q0, k0, partial), q0, k0)
        ds, _ = C.tile_grads(s, v_ref[...], do_ref[...], lse_ref[:, 0:1],
                             delta_ref[:, 0:1])
        ds, d_tile = C.raw_score_grad(side.fx, ds, raw, mask, q0, k0,
                                      with_captures=bool(d_capture_refs))
        for ref, d in zip(d_capture_refs, d_tile):
            ref[...] += d.reshape(ref.shape).astype(ref.dtype)
        dq_scr[...] += C.dot(ds.astype(k.dtype), k, C._NN)

    _steps(blocks_ref, counts_ref, full_ref, side.width, run)

    @pl.when(t == side.width - 1)
    def _():
        dq_ref[...] = (dq_scr[...] * side.cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(blocks_ref, fids_ref, counts_ref, full_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                delta_ref, *refs, side):
    dk_ref, dv_ref, dk_scr, dv_scr = side.unpack(refs)
    plan = side.plan
    t = pl.program_id(1)

    @pl.when(t == 0)
    def _():
        dk_scr[...] = jnp.zeros(dk_scr.shape, STATS_DTYPE)
        dv_scr[...] = jnp.zeros(dv_scr.shape, STATS_DTYPE)

    def run(j, qb, partial):
        q0, k0 = qb * plan.block_q, j * plan.block_k
        q, k, d_out = q_ref[...], k_ref[...], do_ref[...]
        s, raw, mask = side.scores(q, k, side.mask(q0, k0, partial), q0, k0)
        ds, p = C.tile_grads(s, v_ref[...], d_out, lse_ref[:, 0:1],
                             delta_ref[:, 0:1])
        ds, _ = C.raw_score_grad(side.fx, ds, raw, mask, q0, k0, with_captures=False)
        dv_scr[...] += C.dot(p.astype(d_out.dtype), d_out, C._TN)
        dk_scr[...] += C.dot(ds.astype(q.dtype), q, C._TN)

    _steps(blocks_ref, counts_ref, full_ref, side.width, run)

    @pl.when(t == side.width - 1)
    def _():
        dk_ref[...] = (dk_scr[...] * side.cfg.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _call(kernel, side, tables, grid, args, specs, extra, extra_specs, out_shape, out_specs,
          scratch, name):
    return pl.pallas_call(
        functools.partial(kernel, side=side),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(tables),
            grid=grid,
            in_specs=[*specs, *extra_specs],
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM(s, STATS_DTYPE) for s in scratch],
        ),
        out_shape=out_shape,
        compiler_params=_params(),
        interpret=side.cfg.interpret,
        name=name,
    )(*tables, *args, *extra)


def forward(cfg, plan, q, k, v, dyn):
    side = _Side(cfg, plan, row_is_q=True)
    extra, extra_specs, q_idx, k_idx = side.arrays_and_specs(dyn)
    bq, bk, lq_p, dv = plan.block_q, plan.block_k, q.shape[0], v.shape[1]
    specs = [
        pl.BlockSpec((bq, q.shape[1]), lambda *a: (q_idx(*a), 0)),
        pl.BlockSpec((bk, k.shape[1]), lambda *a: (k_idx(*a), 0)),
        pl.BlockSpec((bk, dv), lambda *a: (k_idx(*a), 0)),
    ]
    out, lse = _call(
        _fwd_kernel, side, C.tables(plan.rows, fetch=True), (plan.nq, side.width), (q, k, v),
        specs, extra, extra_specs,
        out_shape=[jax.ShapeDtypeStruct((lq_p, dv), q.dtype),
                   jax.ShapeDtypeStruct((lq_p, LANES), STATS_DTYPE)],
        out_specs=[pl.BlockSpec((bq, dv), lambda *a: (q_idx(*a), 0)),
                   pl.BlockSpec((bq, LANES), lambda *a: (q_idx(*a), 0))],
        scratch=[(bq, LANES), (bq, LANES), (bq, dv)],
        name="xformers_blocksparse_fwd",
    )
    return out, lse[:, 0]


def backward(cfg, plan, q, k, v, dyn, lse, delta, d_out):
    bq, bk, dk_, dv_ = plan.block_q, plan.block_k, q.shape[1], v.shape[1]
    args = (q, k, v, d_out, _lanes(lse[:, None]), _lanes(delta[:, None]))

    def specs(q_idx, k_idx):
        qi = lambda *a: (q_idx(*a), 0)  # noqa: E731
        ki = lambda *a: (k_idx(*a), 0)  # noqa: E731
        return [pl.BlockSpec((bq, dk_), qi), pl.BlockSpec((bk, dk_), ki),
                pl.BlockSpec((bk, dv_), ki), pl.BlockSpec((bq, dv_), qi),
                pl.BlockSpec((bq, LANES), qi), pl.BlockSpec((bq, LANES), qi)]

    side = _Side(cfg, plan, row_is_q=True)
    extra, extra_specs, q_idx, k_idx = side.arrays_and_specs(dyn)
    # Flex: one row per query block of each differentiable capture's cotangent (summed by
    # the caller).
    captures = []
    if cfg.flex is not None:
        start = 1 + int(cfg.flex.has_sink)
        captures = dyn[2][start : start + cfg.flex.counts[0]]
    dq, *d_captures = _call(
        _dq_kernel, side, C.tables(plan.rows, fetch=True), (plan.nq, side.width), args,
        specs(q_idx, k_idx), extra, extra_specs,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)] + [
            jax.ShapeDtypeStruct((plan.nq, *c.shape), STATS_DTYPE) for c in captures],
        out_specs=[pl.BlockSpec((bq, dk_), lambda *a: (q_idx(*a), 0))] + [
            pl.BlockSpec((None, *c.shape), lambda r, *_, n=c.ndim: (r,) + (0,) * n)
            for c in captures],
        scratch=[(bq, dk_)],
        name="xformers_blocksparse_dq",
    )

    side = _Side(cfg, plan, row_is_q=False)
    extra, extra_specs, q_idx, k_idx = side.arrays_and_specs(dyn)
    dk, dv = _call(
        _dkv_kernel, side, C.tables(plan.cols, fetch=True), (plan.nk, side.width), args,
        specs(q_idx, k_idx), extra, extra_specs,
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        out_specs=[pl.BlockSpec((bk, dk_), lambda *a: (k_idx(*a), 0)),
                   pl.BlockSpec((bk, dv_), lambda *a: (k_idx(*a), 0))],
        scratch=[(bk, dk_), (bk, dv_)],
        name="xformers_blocksparse_dkv",
    )
    return dq, dk, dv, d_captures
