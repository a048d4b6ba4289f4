"""Axial attention (Ho et al., 2019, "Axial Attention in Multidimensional Transformers"):
attention along one axis of an N-d tensor at a time, each line of the axis an independent exact
attention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._exact import flash_attention


def _check_shape(name, shape, axis, length):
    shape = tuple(int(s) for s in shape)
    if not shape or any(s <= 0 for s in shape) or math.prod(shape) != length:
        raise ValueError(f"{name}: shape {shape} must be positive sizes whose product is the length {length}")
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"{name}: axis {axis} is out of range for shape {shape}")
    return shape, axis % len(shape)


def _lines(x, shape, axis):
    """``[prod(shape), D] -> [lines, shape[axis], D]``."""
    x = jnp.moveaxis(x.reshape(shape + x.shape[1:]), axis, len(shape) - 1)
    return x.reshape((-1, shape[axis]) + x.shape[len(shape):])


def _unlines(x, shape, axis):
    moved = shape[:axis] + shape[axis + 1:] + (shape[axis],)
    x = jnp.moveaxis(x.reshape(moved + x.shape[2:]), len(shape) - 1, axis)
    return x.reshape((-1,) + x.shape[len(shape):])


def axial_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *,
    shape,
    axis: int,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    implementation: str | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Exact attention along one axis of a tensor flattened in raster (row-major) order.

    Position ``p`` of the sequence is the element ``unravel_index(p, shape)``; it attends to the
    elements that differ from it only along ``axis``. ``causal=True`` masks along the axis
    (``j <= i`` there), which never looks ahead in raster order along any axis; combined with
    :func:`axial_shift` it gives the Axial Transformer's raster-order decoder (Ho et al., 2019).
    Cost ``O(L * shape[axis])``.

    Args:
      q: ``[L, Dk]``, k: ``[L, Dk]``, v: ``[L, Dv]`` with ``L = prod(shape)``.
      shape: the tensor's shape (static), e.g. ``(height, width)``.
      axis: the axis to attend along.
      causal, kv_mask (``bool[L]``), scale, block_q, block_k, implementation: as in
        :func:`flash_attention`, per line.

    Returns:
      ``[L, Dv]``.
    """
    name = "axial_attention"
    x = C.check_qkv(name, q, k, v)
    C.check_same_length(name, x, "self-attention over one tensor needs Lq == Lk")
    kv_mask = C.check_kv_mask(name, kv_mask, x.lk)
    shape, axis = _check_shape(name, shape, axis, x.lq)
    lines = [_lines(a, shape, axis) for a in (x.q, x.k, x.v)]
    masks = None if kv_mask is None else _lines(kv_mask[:, None], shape, axis)[..., 0]

    def one(ql, kl, vl, ml):
        return flash_attention(ql, kl, vl, causal=causal, kv_mask=ml, scale=scale,
                               block_q=block_q, block_k=block_k, implementation=implementation)

    out = jax.vmap(one)(*lines, masks) if masks is not None else jax.vmap(
        lambda a, b, c: one(a, b, c, None))(*lines)
    return _unlines(out, shape, axis)


def axial_shift(x, *, shape, axis: int):
    """Shifts a raster-order ``[prod(shape), D]`` tensor by one step along ``axis`` (zeros first).

    After the shift, element ``(.., r, ..)`` holds what ``(.., r - 1, ..)`` held, so a layer
    reading it conditions only on earlier rows (the "shift down" of the Axial Transformer
    decoder, Ho et al., 2019); along the last axis it is the shift right within a row.
    """
    x = jnp.asarray(x)
    shape, axis = _check_shape("axial_shift", shape, axis, x.shape[0])
    t = x.reshape(shape + x.shape[1:])
    pad = [(0, 0)] * t.ndim
    pad[axis] = (1, 0)
    t = jax.lax.slice_in_dim(jnp.pad(t, pad), 0, shape[axis], axis=axis)
    return t.reshape(x.shape)
