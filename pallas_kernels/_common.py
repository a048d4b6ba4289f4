"""What the GPU and TPU kernels share: tile scores and masks, the kernel object and the VJP.

The tile math is the kernel layer's (``xformers_jax.kernels``), the same functions the
XLA path (``kernels.attend_layout``) runs: the online softmax of FlashAttention (Dao et
al., 2022; Milakov & Gimelshein, 2018) in the forward pass, and a backward pass that
recomputes each tile's probabilities from the saved log-sum-exp, wrapped in the kernel layer's
custom VJP (``kernels.lse_vjp``). Each backend module supplies
``forward(cfg, plan, q, k, v, dyn) -> (out, lse)`` and
``backward(cfg, plan, q, k, v, dyn, lse, delta, d_out) -> (dq, dk, dv)`` on padded inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xformers_jax import kernels
from xformers_jax.kernels import STATS_DTYPE, lse_vjp

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # a.T @ b

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def dot(a, b, dims):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=STATS_DTYPE)


def tile_mask(plan, q0, k0, *, partial, static_mask, kv_valid, q_seg, k_seg):
    """The ``bool[bq, bk]`` mask of one tile, or None when nothing is masked.

    ``static_mask`` is the loaded partial mask (None in band mode); ``kv_valid [1, bk]``,
    ``q_seg [bq, 1]``, ``k_seg [1, bk]`` are the dynamic inputs' slices (or None).
    """
    mask = None
    if partial:
        if plan.band is not None:
            left, right = plan.band
            i = q0 + jax.lax.broadcasted_iota(jnp.int32, (plan.block_q, plan.block_k), 0)
            j = k0 + jax.lax.broadcasted_iota(jnp.int32, (plan.block_q, plan.block_k), 1)
            mask = (j >= i - left) & (j <= i + right) & (j < plan.lk)
        else:
            mask = static_mask
    if kv_valid is not None:
        mask = kernels.and_masks(mask, kv_valid)
    if q_seg is not None:
        mask = kernels.and_masks(mask, q_seg == k_seg)
    return mask


def scores(cfg, q, k, mask):
    s = dot(q, k, _NT) * cfg.scale
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def online_step(s, v, m_old, l_old, acc_old):
    """One online-softmax update with scores ``s [bq, bk]``; ``m, l: [bq, 1]``
    (``kernels.online_step`` with ``p @ v`` in the input dtype)."""
    return kernels.online_step(s, m_old, l_old, acc_old,
                              lambda p: dot(p.astype(v.dtype), v, _NN))


finish = kernels.finish  # (out f32 [bq, dv], lse [bq, 1]); rows that saw no key: 0 and -inf


def tile_grads(s, v, d_out, lse, delta):
    """``(ds [bq, bk] f32, p [bq, bk] f32)`` of one tile, from the saved ``lse`` (+inf for
    rows that saw nothing, so their probabilities are 0) and ``delta = rowsum(dO * O)``."""
    p = kernels.tile_probs(s, lse)
    return kernels.score_grad(p, dot(d_out, v, _NT), delta), p


@dataclasses.dataclass(frozen=True)
class Config(kernels.TileConfig):
    """Static configuration of one kernel call (hashable: part of the jit cache key): the
    kernel layer's tile configuration plus the kernel's tiles and options."""

    block_q: int
    block_k: int
    interpret: bool
    extra: tuple = ()
    num_warps: int | None = None
    num_stages: int | None = None
    runs: bool = True


# The backend's default forward tiles are used while they compute at most this much more of
# the score matrix than the backward's tiles (dense and causal layouts: under 1% more at 8K).
FORWARD_AREA_SLACK = 1.1


def _area(plan) -> int:
    """Score elements the plan's listed tiles cover."""
    return int(plan.rows.counts.sum()) * plan.block_q * plan.block_k


def _extent(plan) -> tuple[int, int]:
    """The query and key rows ``plan``'s tiles cover."""
    return plan.nq * plan.block_q, plan.nk * plan.block_k


def _fit(plan, q, k, v, dyn):
    """The padded inputs cut to the rows ``plan`` covers: the forward and the backward kernels
    may have different tiles, and the inputs are padded for the larger of the two."""
    lq, lk = _extent(plan)
    kv_valid, segs = dyn
    dyn = (None if kv_valid is None else kv_valid[:lk],
           None if segs is None else (segs[0][:lq], segs[1][:lk]))
    return q[:lq], k[:lk], v[:lk], dyn


def _forward(static, q, k, v, extra, dyn):
    backend, cfg, plan, fwd_cfg, fwd_plan = static
    out, lse = backend.forward(fwd_cfg, fwd_plan, *_fit(fwd_plan, q, k, v, dyn))
    # Rows past the forward's tiles are padding: they saw nothing (out 0, lse -inf).
    return (kernels.pad_to(out, q.shape[0], 0),
            kernels.pad_to(lse, q.shape[0], 0, -jnp.inf))


def _backward(static, q, k, v, extra, dyn, out, lse, d_out, d_lse):
    backend, cfg, plan, fwd_cfg, fwd_plan = static
    # A cotangent on the log-sum-exp (callers that merge partial attentions by it, such as
    # Long-Short or ring attention) enters delta, as in the XLA path.
    d_out = d_out.astype(q.dtype)
    lse, delta = kernels.backward_stats(out, lse, d_out, d_lse)
    lq, _ = _extent(plan)
    dq, dk, dv = backend.backward(cfg, plan, *_fit(plan, q, k, v, dyn), lse[:lq], delta[:lq],
                                  d_out[:lq])
    return (kernels.pad_to(dq, q.shape[0], 0), kernels.pad_to(dk, k.shape[0], 0),
            kernels.pad_to(dv, v.shape[0], 0), extra)


_attend = lse_vjp(_forward, _backward)


@dataclasses.dataclass(frozen=True, eq=False)
class PallasAttention:
    """A registered kernel: ``kernel(q, k, v, layout, *, kv_mask, segments, bias, scale,
    dropout_rate, key) -> (out [Lq, Dv], lse f32[Lq])`` for one sequence and one head.

    Differentiable (a ``custom_vjp`` with Pallas backward kernels) and vmappable (Pallas adds
    a grid axis per vmapped dimension). ``interpret=True`` runs the same kernels in Pallas
    interpret mode on any backend (tests on CPU).

    Attributes:
      name: shown in dispatch errors. platform: ``"gpu"`` or ``"tpu"``. backend: the module
      with ``forward``/``backward``/``head_dim``/``block_problems``/``default_blocks``/
      ``default_forward``.
      block_q, block_k: tiles; None takes the backend's default for the call's head dims.
        Tiles given here are every kernel's unless ``forward_blocks`` is given.
      forward_blocks: ``(block_q, block_k)`` of the forward kernel alone; None: the tiles
        above when given, else the backend's forward default (``default_forward``) unless
        that computes over ``FORWARD_AREA_SLACK`` times the backward tiles' score area
        (a fine-grained sparse layout), where the forward keeps the backward's tiles.
      num_warps, num_stages: Triton's launch options (None: the backend's default).
      forward_num_stages: the forward kernel's ``num_stages`` (None: ``num_stages``, else
        the backend's forward default).
      runs: walk consecutive listed blocks by position (``Blocks.runs``) where the plan
        allows, rather than loading each block index (False: always load; for comparison).
    """

    name: str
    platform: str
    backend: Any
    block_q: int | None = None
    block_k: int | None = None
    interpret: bool = False
    extra: tuple = ()
    num_warps: int | None = None
    num_stages: int | None = None
    runs: bool = True
    forward_blocks: tuple[int, int] | None = None
    forward_num_stages: int | None = None

    def blocks(self, dk: int, dv: int) -> tuple[int, int]:
        """The backward kernels' tiles for head dims ``dk``, ``dv``."""
        bq, bk = self.backend.default_blocks(dk, dv)
        return self.block_q or bq, self.block_k or bk

    def forward_options(self, dk: int, dv: int,
                        dtype=jnp.bfloat16) -> tuple[int, int, int | None]:
        """The forward kernel's ``(block_q, block_k, num_stages)`` for head dims ``dk``, ``dv``
        and inputs of ``dtype``."""
        bq, bk, stages = self.backend.default_forward(dk, dv, jnp.dtype(dtype).itemsize)
        if self.forward_blocks is not None:
            bq, bk = self.forward_blocks
        elif self.block_q or self.block_k:
            bq, bk = self.blocks(dk, dv)
        return bq, bk, self.forward_num_stages or self.num_stages or stages

    def plans(self, layout, dk: int, dv: int, dtype):
        """``(plan, forward plan, forward num_stages)`` of ``layout``: the backward kernels'
        plan and the forward's (:meth:`forward_options`; the default forward tiles give way
        to the backward's where they would cover ``FORWARD_AREA_SLACK`` times more scores)."""
        plan = kernels.plan(layout, *self.blocks(dk, dv))
        fwd_q, fwd_k, stages = self.forward_options(dk, dv, dtype)
        fwd_plan = kernels.plan(layout, fwd_q, fwd_k)
        fixed = getattr(self.backend, "FIXED_FORWARD_TILES", False)
        if (self.forward_blocks is None and not fixed
                and _area(fwd_plan) > FORWARD_AREA_SLACK * _area(plan)):
            # Half-empty wider tiles over a fine-grained sparse layout: more work, not less.
            fwd_plan = plan
        return plan, fwd_plan, stages

    def with_options(self, **changes) -> "PallasAttention":
        """A copy with other tiles or ``interpret`` (e.g. ``interpret=True`` for CPU tests)."""
        return dataclasses.replace(self, **changes)

    def unsupported(self, call) -> list[str]:
        """Reasons this kernel cannot run ``call`` (the dispatch dict); empty when it can."""
        why = []
        if not self.interpret and call.get("backend") != self.platform:
            why.append(f"runs on backend {self.platform!r}, not {call.get('backend')!r}")
        if jnp.dtype(call["dtype"]) not in SUPPORTED_DTYPES:
            why.append(f"dtype {jnp.dtype(call['dtype'])} is not one of float32/bfloat16/float16")
        if call.get("dropout_rate", 0.0) > 0.0:
            why.append("attention dropout is not implemented in the kernel")
        if call.get("bias", "none") != "none":
            why.append(f"a {call['bias']} bias is not implemented in the kernel")
        if call.get("flex"):
            why.append("flex attention's " + ", ".join(call["flex"]) + " not implemented in "
                       "the kernel")
        why += self.backend.head_dim_problems(call["dk"], call["dv"])
        if not self.interpret and hasattr(self.backend, "device_problems"):
            why += self.backend.device_problems()
        tiles = self.blocks(call["dk"], call["dv"])
        forward = self.forward_options(call["dk"], call["dv"], call["dtype"])[:2]
        why += self.backend.block_problems(*tiles)
        if forward != tiles:
            why += [f"forward {w}" for w in self.backend.block_problems(*forward)]
        return why

    def __call__(self, q, k, v, layout, *, kv_mask=None, segments=None, bias=None, scale,
                 dropout_rate=0.0, key=None):
        del key
        call = dict(dtype=q.dtype, dropout_rate=dropout_rate,
                    bias="none" if bias is None else "array", dk=q.shape[1], dv=v.shape[1],
                    backend=self.platform)
        why = self.unsupported(call)
        if why:
            raise NotImplementedError(f"{self.name}: " + "; ".join(why))
        plan, fwd_plan, fwd_stages = self.plans(layout, q.shape[1], v.shape[1], q.dtype)
        lq, lk = q.shape[0], k.shape[0]
        lq_p, lk_p = (max(a, b) for a, b in zip(_extent(plan), _extent(fwd_plan)))
        dk_p = self.backend.head_dim(q.shape[1])
        dv_p = self.backend.head_dim(v.shape[1])
        q_p = kernels.pad_to(kernels.pad_to(q, lq_p, 0), dk_p, 1)
        k_p = kernels.pad_to(kernels.pad_to(k, lk_p, 0), dk_p, 1)
        v_p = kernels.pad_to(kernels.pad_to(v.astype(q.dtype), lk_p, 0), dv_p, 1)
        kv_valid = None if kv_mask is None else kernels.pad_to(kv_mask.astype(jnp.int32), lk_p, 0)
        segs = None
        if segments is not None:
            segs = (kernels.pad_to(segments[0], lq_p, 0, -1),
                    kernels.pad_to(segments[1], lk_p, 0, -2))
        cfg = Config(
            scale=float(scale), block_q=plan.block_q, block_k=plan.block_k,
            has_kv_mask=kv_mask is not None, has_segments=segments is not None,
            interpret=self.interpret, extra=self.extra, num_warps=self.num_warps,
            num_stages=self.num_stages, runs=self.runs,
        )
        fwd_cfg = dataclasses.replace(cfg, block_q=fwd_plan.block_q, block_k=fwd_plan.block_k,
                                      num_stages=fwd_stages)
        out, lse = _attend((self.backend, cfg, plan, fwd_cfg, fwd_plan), q_p, k_p, v_p, (),
                           (kv_valid, segs))
        return out[:lq, : v.shape[1]].astype(q.dtype), lse[:lq]


def tables(blocks: "kernels.Blocks", *, fetch: bool):
    """``(blocks, mask ids, counts, full)`` as flat int32 constants (scalar memory is 1-D).

    ``fetch`` picks the pipelined form of the mask ids (no -1; see ``Blocks.fetch_ids``).
    """
    ids = blocks.fetch_ids if fetch else blocks.mask_ids
    return tuple(
        jnp.asarray(np.ascontiguousarray(a).reshape(-1))
        for a in (blocks.blocks, ids, blocks.counts, blocks.full)
    )


def masks_array(plan, dtype=jnp.int32):
    """The partial masks as an integer array (kernels load integers, not bools)."""
    return jnp.asarray(plan.masks.astype(np.int32)).astype(dtype)

