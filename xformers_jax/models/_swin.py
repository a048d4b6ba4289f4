"""Swin Transformer (Liu et al., 2021, "Swin Transformer: Hierarchical Vision Transformer using
Shifted Windows").

Self-attention within non-overlapping ``M x M`` windows of a 2D token grid, with a learned
relative position bias ``B[dy, dx]`` per head (``(2M - 1)^2`` entries); every second block
shifts the grid cyclically by ``M // 2`` before partitioning (and back after), masking pairs
that come from different regions of the wrapped grid, so information crosses window borders.
Stages are joined by patch merging (each ``2 x 2`` group of tokens concatenated, normalised and
projected from ``4C`` to ``2C``): a hierarchy of resolutions as in a CNN.

The shifted windows are equivalent to attention within the groups
``((y + M - s) // M, (x + M - s) // M)`` of the unshifted grid (:func:`window_groups`), which is
how the tests check them.

The model kind ``swin`` (:class:`PixelSwin`) classifies the image tasks' pixel token ids.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import attention as A
from ..nn import FeedForward, LayerNorm
from ._registry import register_model


def window_groups(height: int, width: int, window: int, shift: int) -> np.ndarray:
    """``int[height * width]``: the attention group of each token of a ``height x width`` grid
    under windows of ``window`` shifted by ``shift`` (tokens attend within their group)."""
    y, x = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
    gy, gx = (y + window - shift) // window, (x + window - shift) // window
    return (gy * (width // window + 2) + gx).reshape(-1)


def _relative_index(window: int) -> np.ndarray:
    c = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
    d = c[:, :, None] - c[:, None, :] + window - 1                   # [2, M^2, M^2]
    return d[0] * (2 * window - 1) + d[1]


def _shift_mask(height, width, window, shift) -> np.ndarray:
    """``bool[nW, M^2, M^2]``: which pairs of a shifted window come from the same region."""
    labels = np.zeros((height, width), np.int32)
    cuts = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    n = 0
    for hs in cuts:
        for ws in cuts:
            labels[hs, ws] = n
            n += 1
    w = _partition(labels[None, :, :, None], window)[..., 0]        # [nW, M^2]
    return w[:, :, None] == w[:, None, :]


def _partition(x, window):
    b, h, w, c = x.shape
    x = x.reshape(b, h // window, window, w // window, window, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, window * window, c)


def _merge(x, window, b, h, w):
    c = x.shape[-1]
    x = x.reshape(b, h // window, w // window, window, window, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


class WindowAttention(eqx.Module):
    """(Shifted) window multi-head self-attention with a relative position bias.

    Call: ``x [B, H, W, C]``, ``shift`` (0 or ``M // 2``) -> ``[B, H, W, C]``; ``H`` and ``W``
    must be multiples of the window.
    """

    wqkv: jax.Array
    wo: jax.Array
    rel_table: jax.Array
    num_heads: int = eqx.field(static=True)
    window: int = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, window: int, *, key):
        if dim % num_heads:
            raise ValueError(f"WindowAttention: dim={dim} is not divisible by "
                             f"num_heads={num_heads}")
        k1, k2, k3 = jax.random.split(key, 3)
        self.wqkv = jax.random.normal(k1, (dim, 3 * dim)) / math.sqrt(dim)
        self.wo = jax.random.normal(k2, (dim, dim)) / math.sqrt(dim)
        self.rel_table = 0.02 * jax.random.normal(k3, ((2 * window - 1) ** 2, num_heads))
        self.num_heads, self.window = num_heads, window

    def __call__(self, x, shift: int = 0):
        b, h, w, c = x.shape
        m = self.window
        if h % m or w % m:
            raise ValueError(f"WindowAttention: the grid {h} x {w} must be a multiple of the "
                             f"window {m} in both sides (x has shape {x.shape})")
        if not 0 <= shift < m:
            raise ValueError(f"WindowAttention: shift must be in [0, {m}), got {shift}")
        if shift:
            x = jnp.roll(x, (-shift, -shift), axis=(1, 2))
        win = _partition(x, m)                                       # [B nW, M^2, C]
        nh, hd = self.num_heads, c // self.num_heads
        qkv = (win @ self.wqkv.astype(x.dtype)).reshape(win.shape[0], m * m, 3, nh, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        rel = self.rel_table[_relative_index(m)]                     # [M^2, M^2, heads]
        bias = jnp.broadcast_to(jnp.moveaxis(rel, -1, 0), (win.shape[0], nh, m * m, m * m))
        if shift:
            allowed = jnp.asarray(_shift_mask(h, w, m, shift))       # [nW, M^2, M^2]
            allowed = jnp.tile(allowed, (b, 1, 1))[:, None]
            bias = jnp.where(allowed, bias, -1e9)
        out = A.multihead(A.dot_product_attention, kwarg_axes={"bias": "batch_heads"})(
            q, k, v, bias=bias.astype(jnp.float32))
        out = out.reshape(win.shape[0], m * m, c) @ self.wo.astype(x.dtype)
        out = _merge(out, m, b, h, w)
        if shift:
            out = jnp.roll(out, (shift, shift), axis=(1, 2))
        return out


class SwinBlock(eqx.Module):
    """Pre-norm block: ``x + WMSA(LN(x))``, then ``x + MLP(LN(x))``; ``shift`` 0 (W-MSA) or
    ``M // 2`` (SW-MSA)."""

    norm1: LayerNorm
    attn: WindowAttention
    norm2: LayerNorm
    ffn: FeedForward
    shift: int = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, window: int, *, shift: int = 0,
                 mlp_ratio: int = 4, key):
        k1, k2 = jax.random.split(key)
        self.norm1, self.norm2 = LayerNorm(dim), LayerNorm(dim)
        self.attn = WindowAttention(dim, num_heads, window, key=k1)
        self.ffn = FeedForward(dim, mlp_ratio * dim, key=k2)
        self.shift = shift

    def __call__(self, x):
        # When the grid is one window, shifting would only wrap it: no shift (as the paper).
        shift = self.shift if min(x.shape[1], x.shape[2]) > self.attn.window else 0
        x = x + self.attn(self.norm1(x), shift)
        # The FFN is per token: run it on [B, H W, C] (its sharding names a length axis).
        b, h, w, c = x.shape
        return x + self.ffn(self.norm2(x).reshape(b, h * w, c)).reshape(b, h, w, c)


class PatchMerging(eqx.Module):
    """``[B, H, W, C]`` -> ``[B, H/2, W/2, 2C]``: each 2 x 2 group concatenated (4C), normalised
    and projected to 2C."""

    norm: LayerNorm
    w: jax.Array

    def __init__(self, dim: int, *, key):
        self.norm = LayerNorm(4 * dim)
        self.w = jax.random.normal(key, (4 * dim, 2 * dim)) / math.sqrt(4 * dim)

    def __call__(self, x):
        b, h, w, c = x.shape
        if h % 2 or w % 2:
            raise ValueError(f"PatchMerging: the grid {h} x {w} must have even sides")
        x = jnp.concatenate([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2],
                             x[:, 1::2, 1::2]], axis=-1)
        return self.norm(x) @ self.w.astype(x.dtype)


class SwinClassifier(eqx.Module):
    """A Swin image classifier: patch embedding, stages of (W-MSA, SW-MSA) block pairs joined by
    patch merging, final norm, mean pooling, linear head.

    Arguments: ``num_classes``, ``image_size`` (square side), ``channels``, ``patch`` (side of a
    patch), ``dim`` (first stage width; doubles per stage), ``depths`` (blocks per stage,
    even), ``heads`` (per stage), ``window`` (the window side ``M``), ``key`` (PRNG key).

    Call: ``images [B, S, S, C]`` or flattened pixels ``[B, S*S, C]`` (the LRA image task) ->
    ``logits [B, num_classes]``.
    """

    proj: jax.Array
    stages: tuple
    merges: tuple
    norm: LayerNorm
    head: jax.Array
    image_size: int = eqx.field(static=True)
    patch: int = eqx.field(static=True)

    def __init__(self, num_classes: int, *, image_size: int, channels: int = 1, patch: int = 1,
                 dim: int = 32, depths=(2, 2), heads=(2, 4), window: int = 4, key):
        if image_size % patch:
            raise ValueError(f"SwinClassifier: image_size={image_size} must be a multiple of "
                             f"patch={patch}")
        grid = image_size // patch
        if len(depths) != len(heads) or any(d % 2 for d in depths):
            raise ValueError(f"SwinClassifier: depths {depths} (even: W-MSA/SW-MSA pairs) and "
                             f"heads {heads} must have one entry per stage")
        if grid % (window * 2 ** (len(depths) - 1)):
            raise ValueError(f"SwinClassifier: the {grid} x {grid} patch grid must stay a "
                             f"multiple of the window {window} through {len(depths)} stages")
        keys = iter(jax.random.split(key, 3 + sum(depths) + len(depths)))
        self.proj = jax.random.normal(next(keys), (patch * patch * channels, dim)) / math.sqrt(
            patch * patch * channels)
        stages, merges, d = [], [], dim
        for s, (depth, nh) in enumerate(zip(depths, heads)):
            stages.append(tuple(SwinBlock(d, nh, window, shift=(i % 2) * (window // 2),
                                          key=next(keys)) for i in range(depth)))
            if s < len(depths) - 1:
                merges.append(PatchMerging(d, key=next(keys)))
                d *= 2
        self.stages, self.merges = tuple(stages), tuple(merges)
        self.norm = LayerNorm(d)
        self.head = jax.random.normal(next(keys), (d, num_classes)) / math.sqrt(d)
        self.image_size, self.patch = image_size, patch

    def __call__(self, images):
        s, p = self.image_size, self.patch
        if images.ndim == 3:
            images = images.reshape(images.shape[0], s, s, -1)
        b, h, w, c = images.shape
        if (h, w) != (s, s) or c * p * p != self.proj.shape[0]:
            raise ValueError(f"SwinClassifier: images must be [B, {s}, {s}, "
                             f"{self.proj.shape[0] // (p * p)}] (or flattened [B, {s * s}, C]); "
                             f"got {images.shape}")
        x = images.reshape(b, s // p, p, s // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        x = x.reshape(b, s // p, s // p, p * p * c).astype(self.proj.dtype) @ self.proj
        for i, blocks in enumerate(self.stages):
            for block in blocks:
                x = block(x)
            if i < len(self.merges):
                x = self.merges[i](x)
        x = self.norm(x).mean(axis=(1, 2))
        return x @ self.head.astype(x.dtype)


class PixelSwin(eqx.Module):
    """:class:`SwinClassifier` on pixel token ids ``int[B, S*S]``: intensities ``id / 255`` on
    an ``S``-sided grid (LRA's Image and Pathfinder tasks)."""

    swin: SwinClassifier

    def __call__(self, x, *, mask=None, key=None, return_aux=False):
        logits = self.swin((x.astype(jnp.float32) / 255.0)[..., None])
        return (logits, {}) if return_aux else logits


@register_model("swin", serves=("classification",),
                defaults=dict(dim=512, patch=1, window=4, depths=(2, 2), heads=(2, 4)))
def swin(config, task, key):
    """Swin on a square pixel grid (:class:`PixelSwin`; ``dim``: the first stage's width)."""
    side = math.isqrt(task.seq_len)
    if side * side != task.seq_len:
        raise ValueError(f"model.kind='swin' needs a square image: seq_len={task.seq_len}")
    return PixelSwin(SwinClassifier(
        task.num_classes, image_size=side, channels=1, patch=config.patch, dim=config.dim,
        depths=tuple(config.depths), heads=tuple(config.heads), window=config.window,
        key=key))
