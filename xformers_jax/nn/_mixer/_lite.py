"""Long-Short Range Attention (Wu et al., 2020, "Lite Transformer with Long-Short Range
Attention").

The channels are split in two halves: one goes through multi-head attention (the long-range
branch), the other through a convolution branch (the local context), and the outputs are
concatenated. The convolution branch is a GLU input projection, the lightweight
convolution of Wu et al. (2019, "Pay Less Attention with Lightweight and Dynamic
Convolutions"; ``xformers_jax.mixers.lightweight_conv``) and an output projection.

LSRA implements the token mixer ``"lsra"`` (its record is in ``xformers_jax.mixers.KINDS``),
so any block (and the LRA configs' ``model.mixer.kind``) can use it in place of its attention
sublayer.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ...mixers import lightweight_conv
from .._attention import MultiHeadAttention
from ._base import MixerModule, check_mask
from .._slots import AttentionSpec, implements


@implements("lsra")
class LSRA(MixerModule):
    """Long-Short Range Attention over ``[B, L, dim]``: attention on the first ``dim / 2``
    channels, the lightweight convolution branch on the rest.

    Args:
      dim: model width (even). num_heads: heads of both branches. kernel_size: ``K``.
      spec: the attention branch's kind (any registered :class:`AttentionSpec`, or its name:
        mixer specs from configs give ``spec="flash"``).
      causal, max_len: as :class:`MultiHeadAttention`. key: PRNG key.
    """

    attn: MultiHeadAttention
    w_glu: jax.Array
    kernel: jax.Array
    w_out: jax.Array
    causal: bool = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, *, kernel_size: int = 3,
                 spec: AttentionSpec | str = "dot_product", causal: bool = False,
                 max_len: int = 512, key):
        if dim % 2 or (dim // 2) % num_heads:
            raise ValueError(f"LSRA: dim={dim} must be even with dim/2 divisible by "
                             f"num_heads={num_heads}")
        half = dim // 2
        spec = AttentionSpec(spec) if isinstance(spec, str) else spec
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.attn = MultiHeadAttention(half, num_heads, spec=spec, causal=causal,
                                       max_len=max_len, key=k1)
        self.w_glu = jax.random.normal(k2, (half, 2 * half)) / math.sqrt(half)
        self.kernel = 0.1 * jax.random.normal(k3, (num_heads, kernel_size))
        self.w_out = jax.random.normal(k4, (half, half)) / math.sqrt(half)
        self.causal = causal

    def __call__(self, x, *, kv_mask=None, positions=None, key=None, segment_ids=None):
        x = check_mask("LSRA", x, kv_mask)
        half = x.shape[-1] // 2
        a, c = x[..., :half], x[..., half:]
        # Packed rows: the attention branch masks other documents (its kind must honour
        # segment ids, Kind.segments), the convolution's taps stay inside a document.
        seg = {} if segment_ids is None else {"segment_ids": segment_ids}
        long = self.attn(a, kv_mask=kv_mask, positions=positions, key=key, **seg)
        g = c @ self.w_glu.astype(x.dtype)
        g = g[..., :half] * jax.nn.sigmoid(g[..., half:])
        short = lightweight_conv(g, self.kernel, causal=self.causal, mask=kv_mask,
                                 segment_ids=segment_ids)
        short = short @ self.w_out.astype(x.dtype)
        if kv_mask is not None:
            short = jnp.where(kv_mask[..., None], short, 0)
        return jnp.concatenate([long, short], axis=-1)
