"""A long causal convolution restricted to packed documents, exact, without an ``L x L``
matrix: ``y_t = sum_{s <= t, seg_s = seg_t} h_{t - s} x_s`` for contiguous documents (the
per-document form of the FFT convolutions of S4D, H3 and Hyena; see ``causal_convolve``).

Divide and conquer over a binary tree of blocks (``O(L log^2 L)`` time, static shapes, any
number of documents). A pair ``s < t`` first falls into different halves of one block of size
``2m`` at exactly one level. Documents are contiguous, so the only document that reaches from
a left half into its right half is the one holding the left half's last position ``m - 1``:
at that level the left half's inputs outside that document and the right half's outputs
outside it are masked, and the cross term ``z_r = sum_l h_{m + r - l} x_l`` of every block is
one FFT of size ``2m`` (no wrap-around: ``0 < m + r - l < 2m``), batched over the blocks by a
reshape. The tree goes down to blocks of 2 (pairs at distance 1); distance 0 is ``h_0 x_t``.
On CPU, small FFT levels cost less than taking pairs inside leaves of 8-32 positions directly
(masked taps or a masked Toeplitz product per leaf), forward and backward.

The gradient is written out (``jax.custom_vjp``), because differentiating the levels took
about four times their forward time: the operator is linear, and per level both adjoints (in
the input and in the kernel) are cross-correlations that share the transform of the output
gradient's masked right halves; the kernel's is summed over the blocks before its inverse
transform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..attention.linear._scan import document_starts as document_starts


def _where(keep, x):
    """``x [..., n]`` zeroed where ``keep`` (broadcast against the trailing axes) is False."""
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


def _levels(total):
    """Half sizes ``m = 1, 2, 4, ..., total / 2`` of the tree's blocks."""
    m = 1
    while m < total:
        yield m
        m *= 2


def _halves(seg, m):
    """``bool[blocks, 2m]``: the positions of each block of ``2m`` in the document holding its
    left half's last position (the only document that crosses the middle)."""
    sb = seg.reshape(-1, 2 * m)
    return sb[:, m - 1:m] == sb


def _convolve(x, h, seg):
    """The tree's convolution: x ``[*C, T]``, h ``[*K, T]``, seg ``int[T]`` (``T`` a power of
    two) -> ``[*broadcast(C, K), T]``."""
    total = x.shape[-1]
    y = x * h[..., :1]
    for m in _levels(total):
        crossing = _halves(seg, m)
        xb = x.reshape(*x.shape[:-1], -1, 2 * m)
        left = _where(crossing[:, :m], xb[..., :m])
        hf = jnp.fft.rfft(h[..., :2 * m])[..., None, :]  # [*K, 1, m + 1]
        z = jnp.fft.irfft(jnp.fft.rfft(left, n=2 * m) * hf, n=2 * m)[..., m:]
        z = jnp.pad(_where(crossing[:, m:], z), [(0, 0)] * (z.ndim - 1) + [(m, 0)])
        y = y + z.reshape(*z.shape[:-2], total)
    return y


def _sum_to(a, shape):
    """``a`` summed down to ``shape`` (the axes that broadcasting added or stretched)."""
    a = jnp.sum(a, axis=tuple(range(a.ndim - len(shape))))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and a.shape[i] != 1)
    return jnp.sum(a, axis=stretched, keepdims=True) if stretched else a


@jax.custom_vjp
def _tree(x, h, seg):
    return _convolve(x, h, seg)


def _tree_fwd(x, h, seg):
    return _convolve(x, h, seg), (x, h, seg)


def _tree_bwd(res, g):
    x, h, seg = res
    total = x.shape[-1]
    # Distance 0, then per level the adjoints of z_r = sum_l h_{m + r - l} left_l (right half
    # r, left half l, both masked to the crossing document): in the input, dleft_l = sum_r
    # h_{m + r - l} g_r, the cross-correlation of the right half of g with h; in the kernel,
    # dh_k = sum over blocks and pairs with m + r - l = k of g_r left_l, the cross-correlation
    # of g's right half with x's left half, summed over the blocks in frequency. The right
    # half sits at m..2m - 1 of each frame of 2m: a shift by m, (-1)^k in frequency.
    dx = g * h[..., :1]
    dh = jnp.pad(jnp.sum(g * x, -1, keepdims=True), [(0, 0)] * (g.ndim - 1) + [(0, total - 1)])
    for m in _levels(total):
        crossing = _halves(seg, m)
        left = _where(crossing[:, :m], x.reshape(*x.shape[:-1], -1, 2 * m)[..., :m])
        right = _where(crossing[:, m:], g.reshape(*g.shape[:-1], -1, 2 * m)[..., m:])
        gf = jnp.fft.rfft(right, n=2 * m) * (1 - 2 * (np.arange(m + 1) % 2))
        hf = jnp.fft.rfft(h[..., :2 * m])[..., None, :]
        dleft = jnp.fft.irfft(gf * jnp.conj(hf), n=2 * m)[..., :m]
        dleft = jnp.pad(_where(crossing[:, :m], dleft), [(0, 0)] * (dleft.ndim - 1) + [(0, m)])
        dx = dx + dleft.reshape(*dleft.shape[:-2], total)
        spectrum = jnp.sum(gf * jnp.conj(jnp.fft.rfft(left, n=2 * m)), -2)
        dh = dh + jnp.pad(jnp.fft.irfft(spectrum, n=2 * m),
                          [(0, 0)] * (g.ndim - 1) + [(0, total - 2 * m)])
    zero_seg = np.zeros(seg.shape, jax.dtypes.float0)
    return _sum_to(dx, x.shape), _sum_to(dh, h.shape), zero_seg


_tree.defvjp(_tree_fwd, _tree_bwd)


def document_convolve(u, kernel, segment_ids):
    """``y[t] = sum_{s <= t, seg[s] = seg[t]} kernel[..., t - s] u[s]`` in float32.

    Args:
      u: ``[L, *C]``. kernel: ``[*K, L]`` whose leading axes broadcast against ``C`` (as in
        ``causal_convolve``). segment_ids: ``int[L]``, each document's id on a contiguous run
        of positions; ``0`` is padding: its inputs are dropped (NaN included) and its outputs
        are zero.

    Returns:
      ``[L, *broadcast(C, K)]`` float32.
    """
    length = u.shape[0]
    if segment_ids.shape != (length,):
        raise ValueError(f"document_convolve: segment_ids must be int[L] = [{length}], got "
                         f"{segment_ids.shape} (u {u.shape})")
    # The row padded to a power of two, the pad a document of its own (-1).
    total = 1 << max(length - 1, 0).bit_length()
    pad = total - length
    seg = jnp.pad(segment_ids, (0, pad), constant_values=-1)
    # Positions on the last axis throughout ([*C, T]): the FFTs run along it, with no
    # transposes per level.
    x = _where(segment_ids != 0, jnp.moveaxis(u.astype(jnp.float32), 0, -1))
    x = jnp.pad(x, [(0, 0)] * (u.ndim - 1) + [(0, pad)])
    h = kernel.astype(jnp.float32)
    h = jnp.pad(h, [(0, 0)] * (h.ndim - 1) + [(0, pad)])  # taps past L meet no real pair
    return jnp.moveaxis(_tree(x, h, seg)[..., :length], -1, 0)


def gathered_documents(name, segment_ids, kv_mask, order):
    """The segment ids of a sequence whose real positions were gathered to the front by
    ``order`` (``kv_mask``'s stable argsort, or None): padded positions join the padding
    document 0 behind every real one, so the documents stay contiguous. None passes through."""
    if segment_ids is None:
        return None
    length = segment_ids.shape[0] if kv_mask is None else kv_mask.shape[0]
    if segment_ids.shape != (length,) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"{name}: segment_ids must be int[L] = [{length}], got "
                         f"{segment_ids.dtype}{list(segment_ids.shape)}")
    seg = segment_ids if kv_mask is None else jnp.where(kv_mask, segment_ids, 0)
    return seg if order is None else seg[order]
