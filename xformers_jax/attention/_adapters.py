"""Pieces the families' records share: lifting a one-head function of the contract to an
``attend`` on ``[B, L, H, D]`` arrays (:class:`xformers_jax.kinds.AttentionAdapter`), decoding
steps over grouped key/value heads, and the tiled kernel's hyperparameters."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from ._multihead import multihead

# The hyperparameters of the kinds that run on the tiled kernel (xformers_jax.kernels), as
# ``Kind.hyperparameters`` declarations.
TILES = {
    "block_q": (None, "query tile of the tiled kernel (None: the kernel's default)"),
    "block_k": (None, "key tile of the tiled kernel (None: the kernel's default)"),
}
IMPLEMENTATION = {
    "implementation": (None, "'xla', 'pallas', or None for the fastest that runs here"),
}


def real_only(kv_mask, *arrays):
    """``arrays [B, L, ...]`` with the positions ``kv_mask [B, L]`` marks as padding replaced
    by zeros, by a select (one array alone if one is given; None passes through): what an
    adapter does before computing anything of its own from keys, values or the block input
    (beta gates, global projections, dense maps), so that ``0 * nan`` never reaches a real
    output or a gradient."""
    if kv_mask is None:
        out = arrays
    else:
        out = tuple(None if a is None else jnp.where(
            kv_mask.reshape(*kv_mask.shape, *[1] * (a.ndim - 2)), a, jnp.zeros((), a.dtype))
            for a in arrays)
    return out[0] if len(out) == 1 else out


def lifted(fn: Callable, arg_axes=(), kwarg_axes=None, *, unpack: bool = False,
           takes_q_mask: bool = False) -> Callable:
    """An ``attend`` for a one-head function of the contract, lifted with ``multihead``.

    ``params`` (if not None) is passed as one extra positional argument laid out per
    ``arg_axes`` (with ``unpack=True``, a tuple of them); a bias pytree is mapped over
    ``[batch, heads]``. Grouped-query heads are multihead's: no key/value head is copied.
    ``takes_q_mask``: ``fn`` computes statistics over queries and takes the contract's
    ``q_mask`` (split over the batch); other functions compute each query's output from that
    query alone, so a padded query cannot reach a real output and ``q_mask`` is not passed.
    The returned ``attend`` keeps ``fn`` as ``__wrapped__`` (its hyperparameters' defaults).
    """
    kw_axes = {"bias": "batch_heads", **(kwarg_axes or {})}

    def attend(q, k, v, params, *, causal, kv_mask, bias, key, q_mask=None, **hp):
        extra = () if params is None else tuple(params) if unpack else (params,)
        axes = tuple(arg_axes) * len(extra) if unpack else tuple(arg_axes)[: len(extra)]
        kw = {} if bias is None else {"bias": bias}
        if takes_q_mask:
            kw["q_mask"] = q_mask
        f = multihead(fn, arg_axes=axes, kwarg_axes=kw_axes)
        return f(q, k, v, *extra, causal=causal, kv_mask=kv_mask, key=key, **kw, **hp)

    attend.__wrapped__ = fn
    return attend


def broadcast_state(state, batch, heads):
    """A one-head decoding state broadcast to ``[batch, heads, ...]``."""
    return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (batch, heads, *a.shape)), state)


def grouped_step(step_one, state, q, k, v, *per_head):
    """``step_one(state, q [Dk], k [Dk], v [Dv], *per_head) -> (out, state)`` over ``[B, H,
    ...]`` states and queries and ``[B, Hkv, ...]`` keys and values: q (and every per-head
    argument) is reshaped to ``[B, Hkv, G, ...]`` so the ``G`` query heads of a group share
    their key/value head, which is not copied."""
    b, h = q.shape[:2]
    hkv = k.shape[1]

    def group(x):
        return x.reshape(b, hkv, h // hkv, *x.shape[2:])

    def merge(x):
        return x.reshape(b, h, *x.shape[3:])

    f = jax.vmap(step_one, in_axes=(0, 0, None, None) + (0,) * len(per_head))
    f = jax.vmap(jax.vmap(f))
    out, state = f(jax.tree_util.tree_map(group, state), group(q), k, v,
                   *map(group, per_head))
    return merge(out), jax.tree_util.tree_map(merge, state)
