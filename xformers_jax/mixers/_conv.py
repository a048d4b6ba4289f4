"""The lightweight convolution of Wu et al. (2019, "Pay Less Attention with Lightweight and
Dynamic Convolutions"): a depthwise convolution whose ``K`` taps are softmax-normalised and
shared by the channels of each of ``H`` heads; LSRA's short-range branch (Wu et al., 2020,
"Lite Transformer with Long-Short Range Attention"; the layer is ``nn.LSRA``). Causal
convolutions read positions ``i - K + 1 .. i``; others a centred window."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lightweight_conv(x, kernel, *, causal: bool, mask=None):
    """``x [B, L, C]``, ``kernel [H, K]`` (softmax over K taken here; channel ``c`` uses head
    ``c // (C / H)``) -> ``[B, L, C]``. Padded positions (``mask`` False) are zeroed first so
    they reach no real output."""
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
    out = sum(xp[:, j:j + length] * w[:, j] for j in range(k))
    return out.astype(x.dtype)
