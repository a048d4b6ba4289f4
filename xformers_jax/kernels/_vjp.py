"""The ``custom_vjp`` every tiled attention kernel shares: save the output and the
log-sum-exp, recompute the tiles in the backward pass.

FlashAttention (Dao et al., 2022) never stores the ``[Lq, Lk]`` probabilities: the forward
pass saves only ``out`` and the per-row log-sum-exp, and the backward pass recomputes each
tile's probabilities as ``exp(s - lse)`` (``_tiles.backward_stats`` and ``_tiles.tile_probs``).
:func:`lse_vjp` wraps a back end's forward and backward into that custom VJP; the XLA tiled
kernel (``_tiled``) and the Pallas kernels (``pallas_kernels._common``) both use it.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax


def lse_vjp(forward: Callable, backward: Callable) -> Callable:
    """``attend(static, q, k, v, extra, dyn) -> (out, lse)`` with a recomputing custom VJP.

    ``static`` is hashable and not differentiated; ``extra`` is a pytree of differentiable
    inputs besides q, k, v (a bias, or ``()``); ``dyn`` is a pytree of data (masks, ids, a
    seed) that gets no cotangent.

    Args:
      forward: ``forward(static, q, k, v, extra, dyn) -> (out, lse)``.
      backward: ``backward(static, q, k, v, extra, dyn, out, lse, d_out, d_lse) -> (dq, dk, dv,
        d_extra)``, given the saved ``out`` and ``lse`` and the cotangents of both. Gradients
        may be float32; they are cast to their primal's dtype here.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def attend(static, q, k, v, extra, dyn):
        return forward(static, q, k, v, extra, dyn)

    def attend_fwd(static, q, k, v, extra, dyn):
        out, lse = forward(static, q, k, v, extra, dyn)
        return (out, lse), (q, k, v, extra, dyn, out, lse)

    def attend_bwd(static, res, cotangents):
        q, k, v, extra, dyn, out, lse = res
        d_out, d_lse = cotangents
        dq, dk, dv, d_extra = backward(static, q, k, v, extra, dyn, out, lse, d_out, d_lse)
        d_extra = jax.tree_util.tree_map(lambda g, x: g.astype(x.dtype), d_extra, extra)
        d_dyn = jax.tree_util.tree_map(lambda _: None, dyn)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_extra, d_dyn

    attend.defvjp(attend_fwd, attend_bwd)
    return attend
