"""The short causal depthwise convolution of Mamba, H3 and Hyena (and of PaTH attention's
Householder directions, Yang et al. 2025), with its one-step decoding form. Re-exported by
:mod:`xformers_jax.mixers`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_depthwise_conv(x, w, b, segment_ids=None):
    """The short causal convolution of Mamba, H3 and Hyena: ``y_t = sum_i w_i x_{t - W + 1 + i}
    + b`` per channel. x ``[B, L, C]``, w ``[W, C]``, b ``[C]`` (or None: no bias). With
    ``segment_ids int[B, L]`` (packed documents) a tap reads only its own document.

    Differentiable in reverse mode by its own rule (``jax.custom_vjp``: the taps' cotangents
    shifted back and summed, ``dw`` one reduction per tap), which XLA:CPU runs an order of
    magnitude faster than the backward it derives from the shifted sum. Forward-mode
    differentiation (``jax.jvp``) is therefore not defined for it."""
    y = _conv(x, w, segment_ids)
    return y if b is None else y + b.astype(x.dtype)


def _taps(x, width: int, segment_ids):
    """The ``width`` shifted copies of ``x`` a causal convolution sums (tap ``i`` at ``t``
    reads ``x[t - width + 1 + i]``; zero before the start and, with segment ids, outside the
    document) and their masks (None without segment ids)."""
    length = x.shape[1]
    xp = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
    taps = [xp[:, i: i + length] for i in range(width)]
    if segment_ids is None:
        return taps, None
    sp = jnp.pad(segment_ids, ((0, 0), (width - 1, 0)), constant_values=-1)
    masks = [(sp[:, i: i + length] == segment_ids)[..., None] for i in range(width)]
    return [jnp.where(m, t, jnp.zeros((), t.dtype)) for m, t in zip(masks, taps)], masks


@jax.custom_vjp
def _conv(x, w, segment_ids):
    taps, _ = _taps(x, w.shape[0], segment_ids)
    return sum(t * w[i].astype(x.dtype) for i, t in enumerate(taps))


def _conv_fwd(x, w, segment_ids):
    return _conv(x, w, segment_ids), (x, w, segment_ids)


def _conv_bwd(res, dy):
    x, w, segment_ids = res
    width, length = w.shape[0], x.shape[1]
    taps, masks = _taps(x, width, segment_ids)
    dw = jnp.stack([(t * dy).astype(jnp.float32).sum((0, 1)) for t in taps])
    grads = [dy * w[i].astype(dy.dtype) for i in range(width)]
    if masks is not None:
        grads = [jnp.where(m, g, jnp.zeros((), g.dtype)) for m, g in zip(masks, grads)]
    # Tap i at t read x[t - width + 1 + i]: its cotangent lands width - 1 - i positions back.
    padded = [jnp.pad(g, ((0, 0), (0, width - 1), (0, 0))) for g in grads]
    dx = sum(padded[i][:, width - 1 - i: width - 1 - i + length] for i in range(width))
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_conv.defvjp(_conv_fwd, _conv_bwd)


def causal_depthwise_step(buffer, x_t, w, b):
    """One decoding step of :func:`causal_depthwise_conv`: ``buffer [B, W-1, C]`` holds the
    last ``W - 1`` inputs (oldest first), ``x_t [B, C]`` -> ``(y_t [B, C], buffer)``."""
    window = jnp.concatenate([buffer, x_t[:, None].astype(buffer.dtype)], axis=1)
    y = jnp.einsum("bwc,wc->bc", window, w.astype(buffer.dtype)) + b.astype(buffer.dtype)
    return y, window[:, 1:]
