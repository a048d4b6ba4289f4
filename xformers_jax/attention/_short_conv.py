"""The short causal depthwise convolution of Mamba, H3 and Hyena (and of PaTH attention's
Householder directions, Yang et al. 2025), with its one-step decoding form. Re-exported by
:mod:`xformers_jax.mixers`."""

from __future__ import annotations

import jax.numpy as jnp


def causal_depthwise_conv(x, w, b, segment_ids=None):
    """The short causal convolution of Mamba, H3 and Hyena: ``y_t = sum_i w_i x_{t - W + 1 + i}
    + b`` per channel. x ``[B, L, C]``, w ``[W, C]``, b ``[C]`` (or None: no bias). With
    ``segment_ids int[B, L]`` (packed documents) a tap reads only its own document."""
    width = w.shape[0]
    xp = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
    length = x.shape[1]
    taps = [xp[:, i: i + length] for i in range(width)]
    if segment_ids is not None:
        sp = jnp.pad(segment_ids, ((0, 0), (width - 1, 0)), constant_values=-1)
        taps = [jnp.where((sp[:, i: i + length] == segment_ids)[..., None], t,
                          jnp.zeros((), t.dtype)) for i, t in enumerate(taps)]
    y = sum(t * w[i].astype(x.dtype) for i, t in enumerate(taps))
    return y if b is None else y + b.astype(x.dtype)


def causal_depthwise_step(buffer, x_t, w, b):
    """One decoding step of :func:`causal_depthwise_conv`: ``buffer [B, W-1, C]`` holds the
    last ``W - 1`` inputs (oldest first), ``x_t [B, C]`` -> ``(y_t [B, C], buffer)``."""
    window = jnp.concatenate([buffer, x_t[:, None].astype(buffer.dtype)], axis=1)
    y = jnp.einsum("bwc,wc->bc", window, w.astype(buffer.dtype)) + b.astype(buffer.dtype)
    return y, window[:, 1:]
