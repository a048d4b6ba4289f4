"""GPU (Triton) kernels: block-sparse flash attention, forward and backward.

Flash attention is the special case whose plan lists every key block (``Full``) or the blocks
up to the diagonal (``Causal``, mask evaluated from positions), so one set of kernels serves
both ops. One program per query block (forward, dq) or key block (dk, dv) loops over exactly
the blocks its plan row lists: FULL blocks first without any in-tile mask, then PARTIAL ones.
Where a plan's rows are runs of consecutive blocks (dense, causal, local: ``Blocks.runs``) the
kernels compute each step's block from the run's start; otherwise they read it from the plan
tables in global memory, one scalar per step. The forward kernel may have tiles of its own
(``default_forward``): the padded inputs are cut to each kernel's plan in ``_common``.

Triton rules honoured here: every loaded tile has power-of-two sides (tiles >= 16, head dims
padded to the next power of two, at most 256); 1-D statistics are kept as ``[bq, 1]`` tiles so
no value needs slicing; ``num_warps`` grows with the head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xformers_jax.kernels import STATS_DTYPE

from . import _common as C

MAX_HEAD_DIM = 256
DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64
# Head dims above 64: 128-row query tiles. Measured on an H200 (bf16, B·H = 32, L = 8192,
# ``xformers_jax_experiments/suites/gpu_attention.py``): at D = 128, fwd+bwd took 24.0 ms with 64 x 64
# tiles, 13.9 ms with 128 x 64, 14.6 ms with 128 x 128 and 24.4 ms with 64 x 128; at D = 64,
# 64 x 64 was the fastest fwd+bwd (8.2 ms; 128 x 64: 10.7, 128 x 128: 21.4).
WIDE_BLOCK_Q = 128


# The forward kernel's own tiles. Its program holds one query block and streams key blocks;
# the backward's dk/dv program also holds dK and dV accumulators, so the forward affords
# longer key blocks or deeper pipelining in the same shared memory. Measured on an H200
# (same suite and shapes, forward alone): at D = 64, 64 x 128 took 2.0 ms against 2.4 with
# 64 x 64; at D = 128, 128 x 64 with three pipeline stages 3.1 ms against 3.8 with two (three
# stages exceed the H200's shared memory in the backward kernels at that tile).
FORWARD_BLOCK_K = 128
WIDE_FORWARD_STAGES = 3

# Flex attention's score and mask functions run in these kernels' tiles (``_common.FlexTile``).
FLEX = True
# Primitives the Pallas Triton lowering lacks (jax 0.10.2): a flex function applying one runs on
# the XLA path (``_common.PallasAttention.unsupported``).
FLEX_UNLOWERED = ("gather", "dynamic_slice", "scatter", "scatter-add", "dynamic_update_slice")


def _wide(dk: int, dv: int) -> bool:
    return max(head_dim(dk), head_dim(dv)) > 64


def default_blocks(dk: int, dv: int) -> tuple[int, int]:
    """The backward kernels' default tiles for head dims ``dk``, ``dv`` (``WIDE_BLOCK_Q``)."""
    return (WIDE_BLOCK_Q if _wide(dk, dv) else DEFAULT_BLOCK_Q), DEFAULT_BLOCK_K


def default_forward(dk: int, dv: int, itemsize: int = 2) -> tuple[int, int, int | None]:
    """The forward kernel's default ``(block_q, block_k, num_stages)`` for inputs of
    ``itemsize`` bytes (``FORWARD_BLOCK_K``; None: the launch default). Measured for 16-bit
    inputs only; float32 keeps the backward's tiles. Three stages only up to head dim 128:
    at 256 the query tile and three stages of key and value tiles (bf16: 64 + 3 x 64 KB)
    exceed a Hopper SM's 228 KB of shared memory, as they would at 128 in float32."""
    if itemsize > 2:
        return (*default_blocks(dk, dv), None)
    if _wide(dk, dv):  # the backward's tiles, with deeper pipelining where it fits
        deep = max(head_dim(dk), head_dim(dv)) <= 128
        return (*default_blocks(dk, dv), WIDE_FORWARD_STAGES if deep else None)
    return DEFAULT_BLOCK_Q, FORWARD_BLOCK_K, None


def head_dim(d: int) -> int:
    return max(16, pl.next_power_of_2(d))


def head_dim_problems(dk: int, dv: int) -> list[str]:
    return [f"head dim {d} > {MAX_HEAD_DIM}" for d in (dk, dv) if d > MAX_HEAD_DIM]


def block_problems(bq: int, bk: int) -> list[str]:
    return [
        f"{name}={b} is not a power of two >= 16 (Triton tiles)"
        for name, b in (("block_q", bq), ("block_k", bk))
        if b < 16 or b & (b - 1)
    ]


def _params(cfg, d: int):
    return plgpu.CompilerParams(num_warps=cfg.num_warps or (4 if d <= 64 else 8),
                                num_stages=cfg.num_stages or 2)


def _tables(blocks):
    """The plan tables as flat int32 arrays: listed blocks, mask ids, counts, FULL counts and
    the runs' starts (``Blocks.starts``)."""
    return (*C.tables(blocks, fetch=False),
            jnp.asarray(np.ascontiguousarray(blocks.starts).reshape(-1)))


def _loop(cfg, blocks, tables, r, step, carry):
    """Runs ``step(t, b, carry, partial)`` over row ``r``'s FULL then PARTIAL listed blocks,
    ``b`` being the ``t``-th listed block: computed from the run's start when the rows are
    runs (``Blocks.runs``), so every load of the step depends on ``t`` alone and Triton's
    pipeliner can issue the next step's loads early; else loaded from the table."""
    blocks_ref, _, counts_ref, full_ref, starts_ref = tables
    n_full, n = full_ref[r], counts_ref[r]
    if blocks.runs and cfg.runs:
        first_full, first_partial = starts_ref[2 * r], starts_ref[2 * r + 1]

        def index(t, partial):
            return first_partial + (t - n_full) if partial else first_full + t
    else:
        def index(t, partial):
            del partial
            return blocks_ref[r * blocks.width + t]

    def body(partial):
        return lambda t, c: step(t, index(t, partial), c, partial)

    carry = jax.lax.fori_loop(0, n_full, body(False), carry)
    return jax.lax.fori_loop(n_full, n, body(True), carry)


class _Inputs:
    """Unpacks the optional inputs (masks, mask ids, kv mask, segment ids, flex attention's
    ``b, h``, sink and captured arrays) of a kernel."""

    def __init__(self, cfg, plan, refs):
        refs = list(refs)
        self.masks = refs.pop(0) if plan.masks.size else None
        self.kv_valid = refs.pop(0) if cfg.has_kv_mask else None
        self.q_seg, self.k_seg = (refs.pop(0), refs.pop(0)) if cfg.has_segments else (None, None)
        self.fx = None
        if cfg.flex is not None:
            n = cfg.flex.num_inputs
            self.fx, refs = C.FlexTile(cfg.flex, refs[:n]), refs[n:]
        self.rest = refs

    @staticmethod
    def arrays(cfg, plan, dyn):
        kv_valid, segs, flex = dyn
        out = [C.masks_array(plan, jnp.int32)] if plan.masks.size else []
        if cfg.has_kv_mask:
            out.append(kv_valid[None, :])
        if cfg.has_segments:
            out += [segs[0][:, None], segs[1][None, :]]
        return out + (list(flex) if cfg.flex is not None else [])

    def mask(self, plan, q0, k0, mask_id, partial):
        bk = plan.block_k
        static = None
        if partial and self.masks is not None:
            static = self.masks[mask_id] != 0
        kv_valid = None if self.kv_valid is None else self.kv_valid[:, pl.ds(k0, bk)] != 0
        k_seg = None if self.k_seg is None else self.k_seg[:, pl.ds(k0, bk)]
        q_seg = None if self.q_seg is None else self.q_seg[pl.ds(q0, plan.block_q), :]
        return C.tile_mask(plan, q0, k0, partial=partial, static_mask=static,
                           kv_valid=kv_valid, q_seg=q_seg, k_seg=k_seg)


def _fwd_kernel(blocks_ref, mids_ref, counts_ref, full_ref, starts_ref, q_ref, k_ref, v_ref,
                *refs, cfg, plan):
    ins = _Inputs(cfg, plan, refs)
    o_ref, lse_ref = ins.rest
    bq, bk, width = plan.block_q, plan.block_k, plan.rows.width
    i = pl.program_id(0)
    q0 = i * bq
    q = q_ref[...]
    tables = (blocks_ref, mids_ref, counts_ref, full_ref, starts_ref)

    def step(t, b, carry, partial):
        m, l, acc = carry
        k0 = pl.multiple_of(b * bk, bk)
        mask = ins.mask(plan, q0, k0, mids_ref[i * width + t], partial)
        s, _, _ = C.tile_scores(cfg, q, k_ref[pl.ds(k0, bk), :], mask, ins.fx, q0, k0)
        return C.online_step(s, v_ref[pl.ds(k0, bk), :], m, l, acc)

    if ins.fx is not None:
        init = (*ins.fx.initial_stats(bq), jnp.zeros((bq, o_ref.shape[-1]), STATS_DTYPE))
    else:
        init = (
            jnp.full((bq, 1), -jnp.inf, STATS_DTYPE),
            jnp.zeros((bq, 1), STATS_DTYPE),
            jnp.zeros((bq, o_ref.shape[-1]), STATS_DTYPE),
        )
    out, lse = C.finish(*_loop(cfg, plan.rows, tables, i, step, init))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _dq_kernel(blocks_ref, mids_ref, counts_ref, full_ref, starts_ref, q_ref, k_ref, v_ref,
               do_ref, lse_ref, delta_ref, *refs, cfg, plan):
    ins = _Inputs(cfg, plan, refs)
    dq_ref, *d_capture_refs = ins.rest  # flex: this query block's share of each capture
    bq, bk, width = plan.block_q, plan.block_k, plan.rows.width
    i = pl.program_id(0)
    q0 = i * bq
    q, d_out, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    tables = (blocks_ref, mids_ref, counts_ref, full_ref, starts_ref)

    def step(t, b, carry, partial):
        dq, d_captures = carry
        k0 = pl.multiple_of(b * bk, bk)
        k = k_ref[pl.ds(k0, bk), :]
        mask = ins.mask(plan, q0, k0, mids_ref[i * width + t], partial)
        s, raw, mask = C.tile_scores(cfg, q, k, mask, ins.fx, q0, k0)
        ds, _ = C.tile_grads(s, v_ref[pl.ds(k0, bk), :], d_out, lse, delta)
        ds, d_tile = C.raw_score_grad(ins.fx, ds, raw, mask, q0, k0, with_captures=True)
        d_captures = [a + g.astype(STATS_DTYPE) for a, g in zip(d_captures, d_tile)]
        return dq + C.dot(ds.astype(k.dtype), k, C._NN), d_captures

    init = [jnp.zeros(c.shape, STATS_DTYPE) for c in (ins.fx.floats if ins.fx else ())]
    dq, d_captures = _loop(cfg, plan.rows, tables, i, step,
                           (jnp.zeros(q.shape, STATS_DTYPE), init))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)
    for ref, d in zip(d_capture_refs, d_captures):
        ref[...] = d.reshape(ref.shape)


def _dkv_kernel(blocks_ref, mids_ref, counts_ref, full_ref, starts_ref, q_ref, k_ref, v_ref,
                do_ref, lse_ref, delta_ref, *refs, cfg, plan):
    ins = _Inputs(cfg, plan, refs)
    dk_ref, dv_ref = ins.rest
    bq, bk, width = plan.block_q, plan.block_k, plan.cols.width
    j = pl.program_id(0)
    k0 = j * bk
    k, v = k_ref[...], v_ref[...]
    tables = (blocks_ref, mids_ref, counts_ref, full_ref, starts_ref)

    def step(t, b, carry, partial):
        dk, dv = carry
        q0 = pl.multiple_of(b * bq, bq)
        q = q_ref[pl.ds(q0, bq), :]
        d_out = do_ref[pl.ds(q0, bq), :]
        mask = ins.mask(plan, q0, k0, mids_ref[j * width + t], partial)
        s, raw, mask = C.tile_scores(cfg, q, k, mask, ins.fx, q0, k0)
        ds, p = C.tile_grads(s, v, d_out, lse_ref[pl.ds(q0, bq), :],
                             delta_ref[pl.ds(q0, bq), :])
        ds, _ = C.raw_score_grad(ins.fx, ds, raw, mask, q0, k0, with_captures=False)
        dv = dv + C.dot(p.astype(d_out.dtype), d_out, C._TN)
        dk = dk + C.dot(ds.astype(q.dtype), q, C._TN)
        return dk, dv

    init = (jnp.zeros(k.shape, STATS_DTYPE), jnp.zeros(v.shape, STATS_DTYPE))
    dk, dv = _loop(cfg, plan.cols, tables, j, step, init)
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _whole(x):
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _by_block(size, width):
    return pl.BlockSpec((size, width), lambda b: (b, 0))


def forward(cfg, plan, q, k, v, dyn):
    bq, lq_p, dv = plan.block_q, q.shape[0], v.shape[1]
    extra = _Inputs.arrays(cfg, plan, dyn)
    args = [*_tables(plan.rows), q, k, v, *extra]
    specs = [_whole(a) for a in args]
    specs[5] = _by_block(bq, q.shape[1])
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, plan=plan),
        grid=(plan.nq,),
        in_specs=specs,
        out_specs=[_by_block(bq, dv), _by_block(bq, 1)],
        out_shape=[jax.ShapeDtypeStruct((lq_p, dv), q.dtype),
                   jax.ShapeDtypeStruct((lq_p, 1), STATS_DTYPE)],
        compiler_params=_params(cfg, max(q.shape[1], dv)),
        interpret=cfg.interpret,
        name="xformers_blocksparse_fwd",
    )(*args)
    return out, lse[:, 0]


def backward(cfg, plan, q, k, v, dyn, lse, delta, d_out):
    bq, bk = plan.block_q, plan.block_k
    extra = _Inputs.arrays(cfg, plan, dyn)
    stats = [lse[:, None], delta[:, None]]
    params = _params(cfg, max(q.shape[1], v.shape[1]))

    args = [*_tables(plan.rows), q, k, v, d_out, *stats, *extra]
    specs = [_whole(a) for a in args]
    for n in (5, 8, 9, 10):  # q, dO, lse, delta: this program's query block
        specs[n] = _by_block(bq, args[n].shape[1])
    # Flex: each query block's share of the score function's differentiable captures'
    # cotangents, one row per block (summed by the caller).
    captures = _flex_floats(cfg, dyn)
    dq, *d_captures = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, plan=plan),
        grid=(plan.nq,),
        in_specs=specs,
        out_specs=[_by_block(bq, q.shape[1])] + [
            pl.BlockSpec((None, *c.shape), lambda i, n=c.ndim: (i,) + (0,) * n)
            for c in captures],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)] + [
            jax.ShapeDtypeStruct((plan.nq, *c.shape), STATS_DTYPE) for c in captures],
        compiler_params=params,
        interpret=cfg.interpret,
        name="xformers_blocksparse_dq",
    )(*args)

    args = [*_tables(plan.cols), q, k, v, d_out, *stats, *extra]
    specs = [_whole(a) for a in args]
    for n in (6, 7):  # k, v: this program's key block
        specs[n] = _by_block(bk, args[n].shape[1])
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, plan=plan),
        grid=(plan.nk,),
        in_specs=specs,
        out_specs=[_by_block(bk, k.shape[1]), _by_block(bk, v.shape[1])],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params,
        interpret=cfg.interpret,
        name="xformers_blocksparse_dkv",
    )(*args)
    return dq, dk, dv, d_captures


def _flex_floats(cfg, dyn):
    """The kernel inputs holding the score function's differentiable captures (none without
    flex attention); ``_common.flex_inputs``' order: ``b, h``, the sink, then the captures."""
    if cfg.flex is None:
        return []
    start = 1 + int(cfg.flex.has_sink)
    return dyn[2][start : start + cfg.flex.counts[0]]
