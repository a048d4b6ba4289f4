"""The lightweight convolution of Wu et al. (2019, "Pay Less Attention with Lightweight and
Dynamic Convolutions"): a depthwise convolution whose ``K`` taps are softmax-normalised and
shared by the channels of each of ``H`` heads; LSRA's short-range branch (Wu et al., 2020,
"Lite Transformer with Long-Short Range Attention"; the layer is ``nn.LSRA``). Causal
convolutions read positions ``i - K + 1 .. i``; others a centred window."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lightweight_conv(x, kernel, *, causal: bool, mask=None, segment_ids=None):
    """``x [B, L, C]``, ``kernel [H, K]`` (softmax over K taken here; channel ``c`` uses head
    ``c // (C / H)``) -> ``[B, L, C]``. Padded positions (``mask`` False) are zeroed first so
    they reach no real output. With ``segment_ids int[B, L]`` (packed documents) a tap reads
    only its own document, as the zero padding past a document's ends would alone (the
    softmax is over the kernel's taps, not over data)."""
    b, length, c = x.shape
    h, k = kernel.shape
    if c % h:
        raise ValueError(f"lightweight_conv: {c} channels are not divisible by {h} heads "
                         f"(x{x.shape}, kernel{kernel.shape})")
    if mask is not None:
        x = jnp.where(mask[..., None], x, 0)
    w = jax.nn.softmax(kernel.astype(jnp.float32), axis=-1)
    w = jnp.repeat(w, c // h, axis=0)                                # [C, K]
    left = k - 1 if causal else (k - 1) // 2
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (left, k - 1 - left), (0, 0)))
    taps = [xp[:, j:j + length] for j in range(k)]
    if segment_ids is not None:
        if segment_ids.shape != x.shape[:2]:
            raise ValueError(f"lightweight_conv: segment_ids must be int[B, L] = "
                             f"{list(x.shape[:2])}, got {list(segment_ids.shape)}")
        sp = jnp.pad(segment_ids, ((0, 0), (left, k - 1 - left)), constant_values=-1)
        taps = [jnp.where((sp[:, j:j + length] == segment_ids)[..., None], t, 0)
                for j, t in enumerate(taps)]
    out = sum(t * w[:, j] for j, t in enumerate(taps))
    return out.astype(x.dtype)


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
