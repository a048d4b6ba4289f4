"""Integer quantization of a trained model: int8 post-training quantization (per-channel weight
scales, activations calibrated by max or percentile, or scaled per token at run time), fake
quantization with the straight-through estimator for quantization-aware training, and
weight-only int4.

Symmetric uniform quantization (Jacob et al., 2018, "Quantization and Training of Neural
Networks for Efficient Integer-Arithmetic-Only Inference"; the practical survey's Eq 10-11):
``q = clip(round(x / s), -Q, Q)`` with ``Q = 2**(bits-1) - 1`` and ``x ~ s * q``. A matmul of
quantized operands is computed exactly in integers and rescaled once,
``x @ w ~ s_x * s_w * (q_x @ q_w)``, with ``q_x @ q_w`` an int8 x int8 -> int32 ``dot_general``.
Quantization-aware training (the same paper; Bengio et al., 2013, "Estimating or Propagating
Gradients Through Stochastic Neurons" for the straight-through estimator) runs the forward pass
on ``s * q`` and passes gradients through the rounding unchanged inside the clipping range and
as zero outside it.

The model's matmul weights (``x @ w.astype(dtype)`` in ``nn``) are replaced by array-like
modules (:class:`QuantizedWeight`, :class:`Int4Weight`, :class:`FakeQuantWeight`) whose
``astype`` is a no-op and whose ``__rmatmul__`` computes the quantized product, so the modules
of ``nn`` run unchanged; a layer stack slices their arrays per layer like any parameter. The
embedding table is quantized too (``__getitem__`` gathers int8 rows).

The JAX quantization libraries (qwix, AQT) were evaluated first: both require Flax (qwix
intercepts ``dot_general`` inside Flax modules; AQT's layers are Flax modules), which this
library does not depend on, so this small module is written for Equinox pytrees instead.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# The matmul weights of ``nn``'s models (attention projections, FFN, output heads) and the
# token embedding table; their last path component names them.
MATMUL_WEIGHTS = ("wq", "wk", "wv", "wo", "w1", "w2", "w_gate", "head")
TABLES = ("table",)
MODES = ("int8", "int4", "fake")
_EPS = 1e-12


def qmax(bits: int) -> int:
    """The largest magnitude of a symmetric ``bits``-bit integer, ``2**(bits-1) - 1``."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in [2, 8], got {bits}")
    return 2 ** (bits - 1) - 1


def absmax_scale(x: jax.Array, bits: int = 8, *, axis=None, keepdims=False) -> jax.Array:
    """``max|x| / Q`` over ``axis`` (all axes by default): the scale that maps the largest
    magnitude to the largest integer. Zero-magnitude channels get a tiny positive scale."""
    m = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=keepdims)
    return jnp.maximum(m, _EPS) / qmax(bits)


def quantize(x: jax.Array, scale: jax.Array, bits: int = 8) -> jax.Array:
    """``int8(clip(round(x / scale), -Q, Q))`` (``scale`` broadcasts against ``x``)."""
    q = qmax(bits)
    return jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -q, q).astype(jnp.int8)


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``q * scale`` in ``dtype``."""
    return (q.astype(jnp.float32) * scale).astype(dtype)


def fake_quant(x: jax.Array, scale: jax.Array, bits: int = 8) -> jax.Array:
    """``scale * clip(round(x / scale), -Q, Q)`` in ``x``'s dtype with the straight-through
    estimator: the gradient is the identity where ``|x| <= Q * scale`` and zero outside.
    ``scale`` is treated as a constant (no gradient)."""
    q = qmax(bits)
    s = lax.stop_gradient(jnp.asarray(scale, jnp.float32))
    xf = x.astype(jnp.float32)
    clipped = jnp.clip(xf, -q * s, q * s)  # its gradient: 1 inside the range, 0 outside
    rounded = jnp.round(clipped / s) * s
    return (clipped + lax.stop_gradient(rounded - clipped)).astype(x.dtype)


def int8_matmul(xq: jax.Array, wq: jax.Array) -> jax.Array:
    """``xq [..., k] @ wq [k, n]`` for int8 operands, accumulated in int32 by XLA's
    ``dot_general`` (``preferred_element_type=int32``)."""
    if xq.dtype != jnp.int8 or wq.dtype != jnp.int8:
        raise ValueError(f"int8_matmul: operands must be int8, got {xq.dtype} and {wq.dtype}")
    if wq.ndim != 2 or xq.shape[-1] != wq.shape[0]:
        raise ValueError(f"int8_matmul: cannot contract {xq.shape} with {wq.shape}")
    return lax.dot_general(xq, wq, (((xq.ndim - 1,), (0,)), ((), ())),
                           preferred_element_type=jnp.int32)


@jax.jit
def _int8_per_channel(w):
    """``(int8 values, float32 scale per output channel)`` of ``w [..., k, n]`` (one compiled
    program per shape rather than one per operation)."""
    s = absmax_scale(w, 8, axis=-2)
    return quantize(w, s[..., None, :]), s


def _act_quant(x, act_scale, bits):
    """Activations to integers: the calibrated per-tensor scale, or per row (token) from the
    row's own maximum when ``act_scale`` is None."""
    if act_scale is None:
        s = absmax_scale(x, bits, axis=-1, keepdims=True)
    else:
        s = jnp.asarray(act_scale, jnp.float32)
    return quantize(x, s, bits), s


class QuantizedWeight(eqx.Module):
    """An int8 matrix ``w ~ q * scale`` with one scale per output channel (its last axis).

    ``x @ qw`` quantizes ``x`` to int8 (per-tensor with the calibrated ``act_scale``, else per
    row from the row's maximum), multiplies in int8 x int8 -> int32 and rescales:
    ``s_x * s_w * (q_x @ q_w)`` in ``x``'s dtype. ``qw[ids]`` gathers dequantized rows (an
    embedding table). ``q``: ``int8[..., k, n]``, ``scale``: ``float32[..., n]`` (leading axes:
    a layer stack's), ``act_scale``: ``float32[...]`` or None.
    """

    q: jax.Array
    scale: jax.Array
    act_scale: jax.Array | None = None

    @staticmethod
    def from_float(w: jax.Array, act_scale=None) -> "QuantizedWeight":
        return QuantizedWeight(*_int8_per_channel(w), act_scale)

    @property
    def shape(self):
        return self.q.shape

    @property
    def ndim(self):
        return self.q.ndim

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)

    def astype(self, dtype):
        return self

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize(self.q, self.scale[..., None, :], dtype)

    def __rmatmul__(self, x):
        if self.q.ndim != 2:
            raise ValueError(f"QuantizedWeight: a stacked weight {self.q.shape} must be sliced "
                             "per layer before a matmul")
        xq, sx = _act_quant(x, self.act_scale, 8)
        acc = int8_matmul(xq, self.q)
        return (acc.astype(jnp.float32) * sx * self.scale).astype(x.dtype)

    def __getitem__(self, index):
        return self.q[index].astype(jnp.float32) * self.scale


class Int4Weight(eqx.Module):
    """Weight-only int4: values in ``[-7, 7]`` packed two per byte along the input axis, one
    scale per group of ``group`` input rows and output channel. ``x @ w`` dequantizes to
    ``x``'s dtype and multiplies in floating point (activations stay unquantized).
    ``packed``: ``uint8[..., k/2, n]``, ``scale``: ``float32[..., k/group, n]``."""

    packed: jax.Array
    scale: jax.Array
    group: int = eqx.field(static=True)

    @staticmethod
    def from_float(w: jax.Array, group: int = 32) -> "Int4Weight":
        k, n = w.shape[-2:]
        group = min(group, k)
        if k % 2 or k % group:
            raise ValueError(f"Int4Weight: the input axis {k} of {w.shape} must be even and a "
                             f"multiple of group={group}")
        g = w.reshape(*w.shape[:-2], k // group, group, n)
        s = absmax_scale(g, 4, axis=-2)
        q = quantize(g, s[..., None, :], 4).reshape(w.shape).astype(jnp.int32) + 8
        packed = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).astype(jnp.uint8)
        return Int4Weight(packed, s, group)

    @property
    def shape(self):
        return (*self.packed.shape[:-2], 2 * self.packed.shape[-2], self.packed.shape[-1])

    @property
    def ndim(self):
        return self.packed.ndim

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)

    def astype(self, dtype):
        return self

    def unpack(self) -> jax.Array:
        """The int4 values as ``int8[..., k, n]``."""
        p = self.packed.astype(jnp.int32)
        lo, hi = (p & 15) - 8, (p >> 4) - 8
        q = jnp.stack([lo, hi], axis=-2)  # [..., k/2, 2, n]
        return q.reshape(*p.shape[:-2], 2 * p.shape[-2], p.shape[-1]).astype(jnp.int8)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        q = self.unpack()
        *lead, k, n = q.shape
        g = q.reshape(*lead, k // self.group, self.group, n).astype(jnp.float32)
        return (g * self.scale[..., None, :]).reshape(q.shape).astype(dtype)

    def __rmatmul__(self, x):
        return x @ self.dequantize(x.dtype)


class FakeQuantWeight(eqx.Module):
    """A float weight trained with fake quantization (QAT): ``x @ fw`` computes
    ``fake_quant(x) @ fake_quant(w)`` with the scales the int8 path uses (per output channel for
    ``w``; per row, or the calibrated per-tensor ``act_scale``, for ``x``) and straight-through
    gradients. ``w`` stays a trainable float array; :func:`quantize_model` turns it into int8."""

    w: jax.Array
    act_scale: jax.Array | None = None

    @property
    def shape(self):
        return self.w.shape

    @property
    def ndim(self):
        return self.w.ndim

    @property
    def dtype(self):
        return self.w.dtype

    def astype(self, dtype):
        return self

    def _wq(self):
        return fake_quant(self.w, absmax_scale(self.w, 8, axis=-2, keepdims=True))

    def __rmatmul__(self, x):
        sx = (absmax_scale(x, 8, axis=-1, keepdims=True) if self.act_scale is None
              else self.act_scale)
        return fake_quant(x, sx) @ self._wq().astype(x.dtype)

    def __getitem__(self, index):
        return self._wq()[index]


_WRAPPERS = (QuantizedWeight, Int4Weight, FakeQuantWeight)


def _child(node, key):
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    raise ValueError(f"unsupported tree path component {key!r}")


def get_path(tree, path):
    """The node of ``tree`` at a ``jax.tree_util`` key path."""
    for key in path:
        tree = _child(tree, key)
    return tree


def weight_paths(model, names=MATMUL_WEIGHTS + TABLES):
    """Key paths of the floating-point arrays (2-D, or stacked 3-D) whose field name is in
    ``names`` (already wrapped weights are found through their wrapper)."""
    is_wrapper = lambda x: isinstance(x, _WRAPPERS)  # noqa: E731
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_wrapper)[0]:
        last = path[-1] if path else None
        if (isinstance(last, jax.tree_util.GetAttrKey) and last.name in names
                and (is_wrapper(leaf) or (eqx.is_inexact_array(leaf) and leaf.ndim >= 2))):
            out.append(path)
    return out


def _replace(model, paths, fn):
    if not paths:
        return model
    return eqx.tree_at(lambda m: [get_path(m, p) for p in paths], model,
                       [fn(p, get_path(model, p)) for p in paths])


def _float(w):
    if isinstance(w, FakeQuantWeight):
        return w.w
    if isinstance(w, (QuantizedWeight, Int4Weight)):
        raise ValueError(f"{type(w).__name__} is already quantized")
    return w


def quantize_model(model, mode: str = "int8", *, act_scales=None, group: int = 32,
                   names=MATMUL_WEIGHTS + TABLES):
    """``model`` with its matmul weights (and embedding tables) quantized.

    Args:
      model: an ``nn`` model (float weights, or :class:`FakeQuantWeight` after QAT).
      mode: ``"int8"`` (int8 weights per output channel, int8 x int8 -> int32 matmuls),
        ``"int4"`` (weight-only int4 in groups of ``group`` input rows; tables stay float) or
        ``"fake"`` (:class:`FakeQuantWeight` for quantization-aware training).
      act_scales: ``{path: scale}`` from :func:`calibrate` (per-tensor activation scales);
        without one a weight's activations are scaled per row at run time.
      names: the field names of the weights to quantize.
    """
    if mode not in MODES:
        raise ValueError(f"quantize_model: mode must be one of {MODES}, got {mode!r}")
    act_scales = act_scales or {}
    paths = weight_paths(model, names)

    def one(path, w):
        name = path[-1].name
        act = act_scales.get(jax.tree_util.keystr(path))
        if mode == "fake":
            return FakeQuantWeight(_float(w), act)
        w = _float(w)
        if mode == "int8" or name in TABLES:
            if mode == "int4":
                return w
            return QuantizedWeight.from_float(w, None if name in TABLES else act)
        return Int4Weight.from_float(w, group)

    return _replace(model, paths, one)


def dequantize_model(model):
    """Every quantized or fake-quantized weight back to a float array."""
    def one(path, w):
        if isinstance(w, FakeQuantWeight):
            return w.w
        return w.dequantize() if isinstance(w, (QuantizedWeight, Int4Weight)) else w
    return _replace(model, weight_paths(model), one)


# -- activation calibration ---------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tap(pct, probe, x):
    return x


def _tap_fwd(pct, probe, x):
    return x, (probe, x)


def _tap_bwd(pct, res, g):
    # The "gradient" of the probe is the statistic of the activations that pass here: this
    # collects per-layer statistics out of a scanned layer stack without changing the model.
    probe, x = res
    a = jnp.abs(x.astype(jnp.float32)).reshape(-1)
    stat = jnp.max(a) if pct >= 100 else jnp.percentile(a, pct)
    return jnp.broadcast_to(stat, probe.shape).astype(probe.dtype), g


_tap.defvjp(_tap_fwd, _tap_bwd)


class _Observed(eqx.Module):
    w: jax.Array
    probe: jax.Array
    pct: float = eqx.field(static=True)

    def astype(self, dtype):
        return self

    def __rmatmul__(self, x):
        return _tap(self.pct, self.probe, x) @ self.w.astype(x.dtype)


def calibrate(model, batches, apply, *, method: str = "max", percentile: float = 99.99,
              names=MATMUL_WEIGHTS):
    """Per-tensor activation scales for every matmul weight, from a few batches.

    ``apply(model, batch) -> array`` runs the model (e.g. the task's logits). ``method="max"``
    takes the largest ``|x|`` over all batches; ``"percentile"`` the mean over batches of the
    ``percentile``-th percentile of ``|x|`` (clipping rare outliers). Returns ``{path: scale}``
    for :func:`quantize_model` (stacked weights get one scale per layer).
    """
    if method not in ("max", "percentile"):
        raise ValueError(f"calibrate: method must be 'max' or 'percentile', got {method!r}")
    pct = 100.0 if method == "max" else float(percentile)
    paths = weight_paths(model, names)
    observed = _replace(model, paths, lambda p, w: _Observed(
        _float(w), jnp.zeros(_float(w).shape[:-2], jnp.float32), pct))

    @eqx.filter_jit
    def stats(observed, batch):
        def total(ps):
            m = eqx.tree_at(lambda m: [get_path(m, p).probe for p in paths], observed, ps)
            return jnp.sum(apply(m, batch).astype(jnp.float32))
        return jax.grad(total)([get_path(observed, p).probe for p in paths])

    per_batch = [stats(observed, b) for b in batches]
    if not per_batch:
        raise ValueError("calibrate: no batches")
    reduce = np.max if method == "max" else np.mean  # on the host: a few small arrays
    stacked = [reduce(np.stack([np.asarray(s[i]) for s in per_batch]), axis=0)
               for i in range(len(paths))]
    return {jax.tree_util.keystr(p): jnp.asarray(
        (np.maximum(s, _EPS) / qmax(8)).astype(np.float32)) for p, s in zip(paths, stacked)}


def absmax_from_stat(stat: jax.Array, bits: int = 8) -> jax.Array:
    """The scale mapping a calibrated magnitude to the largest integer."""
    return jnp.maximum(stat, _EPS) / qmax(bits)


def model_bytes(model) -> int:
    """Bytes of every array in ``model`` (what a checkpoint stores)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(model)
               if eqx.is_array(x))
