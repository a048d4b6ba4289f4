"""Gradient-based subword tokenization, GBST (Tay et al., 2021, "Charformer: Fast Character
Transformers via Gradient-based Subword Tokenization").

Byte embeddings ``X [L, d]`` become soft sub-word representations:

1. a depthwise 1D convolution over positions (so that blocks know their position);
2. for each candidate block size ``b = 1 .. M``, the sequence is cut into non-overlapping
   blocks of ``b`` bytes and each block is mean-pooled: ``X_b``; the block is scored by a
   linear scoring network ``p_b = X_b w`` (``w [d]``), and both are repeated back to every
   byte of the block (length ``L``);
3. the scores are normalised over block sizes per position, ``P_i = softmax_b(p_{b,i})``,
   optionally calibrated by ``P <- softmax(P P^T) P`` (positions exchanging their block
   preferences);
4. ``X~_i = sum_b P_{b,i} X_{b,i}``;
5. optionally down-sampled by mean pooling with rate ``d_s``.

Padding: padded bytes (``mask`` False) are zeroed before the convolution and excluded from
every mean and from the calibration, so a padded sequence gives the same real outputs as the
unpadded one; the down-sampled mask is True where a pooled block holds a real byte.

Causal use (a byte-level decoder): the convolution reads positions ``i - K + 1 .. i``, the
block of size ``b`` at byte ``i`` is the mean of the block's bytes up to ``i`` (a prefix mean),
and calibration (which mixes all positions) and down-sampling (a pooled block holds bytes after
its first) are refused with a clear error. Tay et al. use GBST in encoders only.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp


def _block_means(x, w, b: int, causal: bool):
    """Mean of each byte's size-``b`` block over the real bytes (``w [B, L]`` 0/1 weights),
    repeated back to ``[B, L, d]``; prefix means within the block when ``causal``."""
    bsz, length, d = x.shape
    n = -(-length // b)
    pad = n * b - length
    xp = jnp.pad(x * w[..., None], ((0, 0), (0, pad), (0, 0))).reshape(bsz, n, b, d)
    wp = jnp.pad(w, ((0, 0), (0, pad))).reshape(bsz, n, b)
    if causal:
        s, c = jnp.cumsum(xp, 2), jnp.cumsum(wp, 2)
    else:
        s = jnp.broadcast_to(xp.sum(2, keepdims=True), xp.shape)
        c = jnp.broadcast_to(wp.sum(2, keepdims=True), wp.shape)
    mean = s / jnp.maximum(c, 1.0)[..., None]
    return mean.reshape(bsz, n * b, d)[:, :length]


class GBST(eqx.Module):
    """The GBST module: ``bytes [B, L, d]`` (embedded) -> ``([B, ceil(L / d_s), d], mask)``.

    Args:
      dim: ``d``. max_block: ``M``, block sizes ``1 .. M``. downsample: ``d_s`` (1: none).
      conv_size: taps of the depthwise convolution (default ``M``). calibrate: score
      calibration. causal: see the module docstring. key: PRNG key.
    """

    conv: jax.Array
    score: jax.Array
    max_block: int = eqx.field(static=True)
    downsample: int = eqx.field(static=True)
    calibrate: bool = eqx.field(static=True)
    causal: bool = eqx.field(static=True)

    def __init__(self, dim: int, *, max_block: int = 4, downsample: int = 1,
                 conv_size: int | None = None, calibrate: bool = False, causal: bool = False,
                 key):
        if max_block < 1 or downsample < 1:
            raise ValueError(f"GBST: max_block={max_block} and downsample={downsample} must be "
                             ">= 1")
        if causal and (calibrate or downsample > 1):
            raise ValueError("GBST: causal=True cannot calibrate (softmax(P P^T) mixes every "
                             "position) or down-sample (a pooled block holds bytes after its "
                             "first); use calibrate=False, downsample=1")
        k1, k2 = jax.random.split(key)
        kk = max_block if conv_size is None else conv_size
        self.conv = jax.random.normal(k1, (kk, dim)) / math.sqrt(kk)
        self.score = jax.random.normal(k2, (dim,)) / math.sqrt(dim)
        self.max_block, self.downsample = max_block, downsample
        self.calibrate, self.causal = calibrate, causal

    def _convolve(self, x):
        kk = self.conv.shape[0]
        left = kk - 1 if self.causal else (kk - 1) // 2
        xp = jnp.pad(x, ((0, 0), (left, kk - 1 - left), (0, 0)))
        length = x.shape[1]
        return sum(xp[:, j:j + length] * self.conv[j].astype(x.dtype) for j in range(kk))

    def block_scores(self, x, *, mask=None):
        """``(P [B, L, M] after the softmax (and calibration), X_b [B, L, M, d])``."""
        bsz, length, d = x.shape
        if d != self.score.shape[0]:
            raise ValueError(f"GBST: inputs must be [B, L, {self.score.shape[0]}], got {x.shape}")
        w = jnp.ones((bsz, length), x.dtype) if mask is None else mask.astype(x.dtype)
        h = self._convolve(x * w[..., None]) * w[..., None]
        blocks = jnp.stack([_block_means(h, w, b, self.causal)
                            for b in range(1, self.max_block + 1)], axis=2)
        logits = jnp.einsum("blmd,d->blm", blocks, self.score.astype(x.dtype))
        p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        if self.calibrate:
            sim = jnp.einsum("bim,bjm->bij", p, p)
            if mask is not None:
                sim = jnp.where(mask[:, None, :], sim, -jnp.inf)
            p = jnp.einsum("bij,bjm->bim", jax.nn.softmax(sim, axis=-1), p)
        return p.astype(x.dtype), blocks

    def __call__(self, x, *, mask=None):
        p, blocks = self.block_scores(x, mask=mask)
        y = jnp.einsum("blm,blmd->bld", p, blocks)
        bsz, length, d = y.shape
        w = jnp.ones((bsz, length), y.dtype) if mask is None else mask.astype(y.dtype)
        y = y * w[..., None]
        if self.downsample == 1:
            return y, mask
        r = self.downsample
        n = -(-length // r)
        pad = n * r - length
        ys = jnp.pad(y, ((0, 0), (0, pad), (0, 0))).reshape(bsz, n, r, d).sum(2)
        ws = jnp.pad(w, ((0, 0), (0, pad))).reshape(bsz, n, r).sum(2)
        out = ys / jnp.maximum(ws, 1.0)[..., None]
        return out, (None if mask is None else ws > 0)
