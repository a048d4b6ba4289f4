"""What the GPU and TPU kernels share: tile scores and masks, the kernel object and the VJP.

The tile math is the kernel layer's (``xformers_jax.kernels``), the same functions the
XLA path (``kernels.attend_layout``) runs: the online softmax of FlashAttention (Dao et
al., 2022; Milakov & Gimelshein, 2018) in the forward pass, and a backward pass that
recomputes each tile's probabilities from the saved log-sum-exp, wrapped in the kernel layer's
custom VJP (``kernels.lse_vjp``). Each backend module supplies
``forward(cfg, plan, q, k, v, dyn) -> (out, lse)`` and
``backward(cfg, plan, q, k, v, dyn, lse, delta, d_out) -> (dq, dk, dv, d_captures)`` on padded
inputs; ``dyn = (kv_valid, segment ids, flex inputs)``, each None when absent, and
``d_captures`` each query block's share of the score function's captures' cotangents
(flex attention, :class:`FlexTile`; empty without).
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


def tile_scores(cfg, q, k, mask, fx, q0, k0):
    """``(s, raw, mask)`` of one tile at ``(q0, k0)``: the scores with flex attention's score
    function applied and masked (its mask function ANDed in), the scaled scores before the
    score function (the point its derivative is taken at), and the final mask. ``fx``: the
    tile's :class:`FlexTile`, or None (plain attention: ``raw`` is ``s`` unmasked)."""
    raw = dot(q, k, _NT) * cfg.scale
    s = raw
    if fx is not None:
        pos = fx.positions(q0, k0, *raw.shape)
        s = fx.score(raw, pos)
        mask = fx.mask(mask, pos)
    return (s if mask is None else jnp.where(mask, s, -jnp.inf)), raw, mask


def raw_score_grad(fx, ds, raw, mask, q0, k0, with_captures: bool):
    """``(ds_raw, d_captures)``: the cotangent of a tile's modified scores ``ds`` taken back
    through the score function at the raw scores (``jax.vjp`` inside the tile), and with
    ``with_captures`` the tile's share of its differentiable captured arrays' cotangents
    (``[]`` otherwise). Masked entries get 0 (the score function's derivative may be
    infinite or NaN there, and their probability is 0 anyway)."""
    if fx is None or fx.flex.score_fn is None:
        return ds, []
    pos = fx.positions(q0, k0, *raw.shape)
    if with_captures:
        _, pull = jax.vjp(lambda s, c: fx.score(s, pos, c), raw, fx.floats)
        ds, d_captures = pull(ds)
    else:
        _, pull = jax.vjp(lambda s: fx.score(s, pos), raw)
        (ds,), d_captures = pull(ds), []
    if mask is not None:
        ds = jnp.where(mask, ds, 0.0)
    return ds, d_captures


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
    flex: "Flex | None" = None


@dataclasses.dataclass(frozen=True, eq=False)
class Flex:
    """Flex attention's static part in a kernel call (hashed by identity).

    ``score_fn``/``mask_fn``: the score and mask functions closure-converted at the kernel's
    tile (``kernels.convert_flex``; None when absent); ``has_sink``: every row's softmax
    starts from a sink logit; ``counts``: how many differentiable captures of the score
    function, other captures of it, and captures of the mask function there are;
    ``shapes``: their ``(shape, dtype)``, in that order. In the kernel the inputs are
    :func:`flex_inputs`' list, read back by :class:`FlexTile`.
    """

    score_fn: Any
    mask_fn: Any
    has_sink: bool
    counts: tuple[int, int, int]
    shapes: tuple
    score_mod: Any = None  # the score function as given (kernels that trace it at their tile)
    tile: tuple[int, int] | None = None  # the tile score_fn and mask_fn were traced at

    @property
    def num_inputs(self) -> int:
        return 1 + int(self.has_sink) + len(self.shapes)


def _as_input(x):
    """A captured array as a kernel input: at least 1-D, bools as int32 (kernels load
    neither 0-D blocks nor bools)."""
    x = jnp.asarray(x)
    x = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
    return x.reshape((1,)) if x.ndim == 0 else x


def flex_inputs(bh, sink, floats, score_data, mask_data) -> list:
    """The kernel inputs :class:`FlexTile` reads: ``b, h`` (``int32[1, 2]``), the sink
    (``f32[1, 1]``, when there is one), then every captured array (:func:`_as_input`). The
    scalars are 2-D so that a block of them (vmapped: one row per program) spans whole
    dimensions, as Mosaic requires of every block, scalar memory included."""
    out = [jnp.reshape(bh, (1, 2))]
    out += [jnp.reshape(sink, (1, 1))] if not isinstance(sink, tuple) else []
    return out + [_as_input(c) for c in (*floats, *score_data, *mask_data)]


class FlexTile:
    """Flex attention inside a kernel: ``b``, ``h``, the sink and the captured arrays loaded
    from the kernel's flex input refs (:func:`flex_inputs`' order), and the score and mask
    functions evaluated on a tile."""

    def __init__(self, flex: Flex, refs):
        refs = list(refs)
        self.flex = flex
        bh = refs.pop(0)
        self.b, self.h = bh[0, 0], bh[0, 1]
        self.sink = refs.pop(0)[0, 0] if flex.has_sink else None
        values = []
        for ref, (shape, dtype) in zip(refs, flex.shapes):
            x = ref[...].reshape(shape)
            values.append(x != 0 if jnp.dtype(dtype) == jnp.bool_ else x)
        n_floats, n_data, _ = flex.counts
        self.floats = values[:n_floats]
        self.data = values[n_floats : n_floats + n_data]
        self.mask_data = values[n_floats + n_data :]

    @staticmethod
    def positions(q0, k0, bq: int, bk: int):
        """``(q_pos int32[bq, 1], k_pos int32[1, bk])`` of the tile at ``(q0, k0)``."""
        return (q0 + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0),
                k0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1))

    def score(self, s, pos, floats=None):
        """The score function on ``s f32[bq, bk]`` (``floats``: the captures to use)."""
        if self.flex.score_fn is None:
            return s
        floats = self.floats if floats is None else floats
        out = self.flex.score_fn(s, self.b, self.h, *pos, floats, self.data)
        return jnp.broadcast_to(out, s.shape).astype(STATS_DTYPE)

    def mask(self, mask, pos):
        """``mask`` ANDed with the mask function's tile (``mask`` None: all True)."""
        if self.flex.mask_fn is None:
            return mask
        got = self.flex.mask_fn(self.b, self.h, *pos, [], self.mask_data)
        return kernels.and_masks(mask, jnp.broadcast_to(got, (pos[0].shape[0], pos[1].shape[1])))

    def initial_stats(self, bq: int):
        """The online softmax's starting ``(m, l)`` ``[bq, 1]``: the sink logit with weight
        ``exp(0)`` when there is one (it takes part in every row's normaliser), else empty."""
        if self.sink is None:
            return (jnp.full((bq, 1), -jnp.inf, STATS_DTYPE), jnp.zeros((bq, 1), STATS_DTYPE))
        return (jnp.full((bq, 1), self.sink, STATS_DTYPE), jnp.ones((bq, 1), STATS_DTYPE))


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
    kv_valid, segs, flex = dyn
    dyn = (None if kv_valid is None else kv_valid[:lk],
           None if segs is None else (segs[0][:lq], segs[1][:lk]), flex)
    return q[:lq], k[:lk], v[:lk], dyn


def _with_flex(cfg, extra, dyn):
    """The kernels' ``dyn``: ``(kv_valid, segs, flex inputs or None)``. The custom VJP holds
    flex attention's differentiable pieces (captures, sink) in ``extra`` and its data (``b,
    h``, other captures) in ``dyn``; the kernels take them all as inputs."""
    kv_valid, segs, flex_data = dyn
    if cfg.flex is None:
        return kv_valid, segs, None
    floats, sink = extra
    bh, score_data, mask_data = flex_data
    return kv_valid, segs, flex_inputs(bh, sink, floats, score_data, mask_data)


def _forward(static, q, k, v, extra, dyn):
    backend, cfg, plan, fwd_cfg, fwd_plan = static
    dyn = _with_flex(cfg, extra, dyn)
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
    dq, dk, dv, d_floats = backend.backward(
        cfg, plan, *_fit(plan, q, k, v, _with_flex(cfg, extra, dyn)), lse[:lq], delta[:lq],
        d_out[:lq])
    grads = (kernels.pad_to(dq, q.shape[0], 0), kernels.pad_to(dk, k.shape[0], 0),
             kernels.pad_to(dv, v.shape[0], 0))
    if cfg.flex is None:
        return (*grads, extra)
    floats, sink = extra
    # The dq kernel gives each query block's share of a capture's cotangent: summed here.
    d_floats = [jnp.sum(d, axis=0).reshape(c.shape) for d, c in zip(d_floats, floats)]
    d_sink = ()
    if cfg.flex.has_sink:  # -sum_i exp(z - lse_i) delta_i; lse is finite where a row is real
        d_sink = -jnp.sum(jnp.where(jnp.isfinite(lse), jnp.exp(sink - lse) * delta, 0.0))
    return (*grads, (d_floats, d_sink))


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

    def plans(self, layout, dk: int, dv: int, dtype, flex: bool = False):
        """``(plan, forward plan, forward num_stages)`` of ``layout``: the backward kernels'
        plan and the forward's (:meth:`forward_options`; the default forward tiles give way
        to the backward's where they would cover ``FORWARD_AREA_SLACK`` times more scores).
        With ``flex`` the forward runs on the backward's tiles: flex attention's functions
        are traced at one tile shape, shared by every kernel of the call (unless the backend
        traces them at its own tiles: ``FLEX_OWN_TILES``)."""
        plan = kernels.plan(layout, *self.blocks(dk, dv))
        fwd_q, fwd_k, stages = self.forward_options(dk, dv, dtype)
        if flex and not getattr(self.backend, "FLEX_OWN_TILES", False):
            return plan, plan, self.forward_num_stages or self.num_stages or stages
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
        if call.get("flex") and not getattr(self.backend, "FLEX", False):
            why.append("flex attention's " + ", ".join(call["flex"]) + " not implemented in "
                       "the kernel")
        unlowered = sorted(set(call.get("flex_primitives", ()))
                           & set(getattr(self.backend, "FLEX_UNLOWERED", ())))
        if unlowered and not self.interpret:
            why.append("flex attention's functions apply " + ", ".join(unlowered) + " (indexing "
                       "a captured array by b, h or position), which Pallas does not lower "
                       "for this kernel")
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
                 dropout_rate=0.0, key=None, score_mod=None, mask_mod=None, sink=None,
                 index=(0, 0)):
        """Flex attention's ``score_mod``, ``mask_mod``, ``sink`` and ``index = (b, h)`` are
        ``kernels.attend_layout``'s (backends with ``FLEX = True``): the functions run in
        every kernel's tiles, the score function differentiated there."""
        del key
        flex_names = tuple(n for n, x in (("score_mod", score_mod), ("mask_mod", mask_mod),
                                          ("sink", sink)) if x is not None)
        call = dict(dtype=q.dtype, dropout_rate=dropout_rate,
                    bias="none" if bias is None else "array", dk=q.shape[1], dv=v.shape[1],
                    backend=self.platform, flex=flex_names)
        why = self.unsupported(call)
        if why:
            raise NotImplementedError(f"{self.name}: " + "; ".join(why))
        plan, fwd_plan, fwd_stages = self.plans(layout, q.shape[1], v.shape[1], q.dtype,
                                                flex=bool(flex_names))
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
        flex, extra, flex_data = None, (), None
        if flex_names:
            score_fn, floats, score_data, mask_fn, mask_data = kernels.convert_flex(
                score_mod, mask_mod, plan.block_q, plan.block_k)
            captures = (*floats, *score_data, *mask_data)
            flex = Flex(score_fn, mask_fn, sink is not None,
                        (len(floats), len(score_data), len(mask_data)),
                        tuple((c.shape, jnp.dtype(c.dtype)) for c in captures), score_mod,
                        (plan.block_q, plan.block_k))
            extra = (floats, () if sink is None else jnp.asarray(sink, STATS_DTYPE))
            flex_data = (jnp.stack([jnp.asarray(i, jnp.int32) for i in index]),
                         score_data, mask_data)
        cfg = Config(
            scale=float(scale), block_q=plan.block_q, block_k=plan.block_k,
            has_kv_mask=kv_mask is not None, has_segments=segments is not None,
            interpret=self.interpret, extra=self.extra, num_warps=self.num_warps,
            num_stages=self.num_stages, runs=self.runs, flex=flex,
        )
        fwd_cfg = dataclasses.replace(cfg, block_q=fwd_plan.block_q, block_k=fwd_plan.block_k,
                                      num_stages=fwd_stages)
        out, lse = _attend((self.backend, cfg, plan, fwd_cfg, fwd_plan), q_p, k_p, v_p, extra,
                           (kv_valid, segs, flex_data))
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

