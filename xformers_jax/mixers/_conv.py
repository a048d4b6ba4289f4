"""The lightweight convolution of Wu et al. (2019, "Pay Less Attention with Lightweight and
Dynamic Convolutions"): a depthwise convolution whose ``K`` taps are softmax-normalised and
shared by the channels of each of ``H`` heads; LSRA's short-range branch (Wu et al., 2020,
"Lite Transformer with Long-Short Range Attention"; the layer is ``nn.LSRA``). Causal
convolutions read positions ``i - K + 1 .. i``; others a centred window."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The short causal convolution lives beside attention (PaTH's Householder directions use it,
# and attention may not import this package); re-exported here for the mixers.
from ..attention._short_conv import causal_depthwise_conv as causal_depthwise_conv
from ..attention._short_conv import causal_depthwise_step as causal_depthwise_step


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
