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
reshape. Pairs inside a leaf of ``C`` positions are taken directly, tap by tap (``C``
elementwise products over the row).
"""

from __future__ import annotations

import jax.numpy as jnp

# Positions per leaf of the tree: pairs closer than this inside one leaf are taken tap by tap
# (C elementwise passes over the row) instead of by FFTs of small sizes.
DOCUMENT_LEAF = 32


def _mask(keep, x):
    """``x [n, ...]`` (or ``[nb, n, ...]``) zeroed where ``keep`` (the leading axes) is False."""
    keep = keep.reshape(keep.shape + (1,) * (x.ndim - keep.ndim))
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


def document_convolve(u, kernel, segment_ids, *, leaf: int = DOCUMENT_LEAF):
    """``y[t] = sum_{s <= t, seg[s] = seg[t]} kernel[..., t - s] u[s]`` in float32.

    Args:
      u: ``[L, *C]``. kernel: ``[*K, L]`` whose leading axes broadcast against ``C`` (as in
        ``causal_convolve``). segment_ids: ``int[L]``, each document's id on a contiguous run
        of positions; ``0`` is padding: its inputs are dropped (NaN included) and its outputs
        are zero. leaf: positions per leaf of the tree (a power of two).

    Returns:
      ``[L, *broadcast(C, K)]`` float32.
    """
    length = u.shape[0]
    if segment_ids.shape != (length,):
        raise ValueError(f"document_convolve: segment_ids must be int[L] = [{length}], got "
                         f"{segment_ids.shape} (u {u.shape})")
    if leaf < 1 or leaf & (leaf - 1):
        raise ValueError(f"document_convolve: leaf must be a power of two, got {leaf}")
    # The row padded to a leaf times a power of two, the pad a document of its own (-1).
    leaf = min(leaf, 1 << max(length - 1, 0).bit_length())
    total = leaf
    while total < length:
        total *= 2
    pad = total - length
    seg = jnp.pad(segment_ids, (0, pad), constant_values=-1)
    x = _mask(segment_ids != 0, u.astype(jnp.float32))
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (u.ndim - 1))
    h = kernel.astype(jnp.float32)
    h = jnp.pad(h, [(0, 0)] * (h.ndim - 1) + [(0, pad)])  # taps past L meet no real pair

    # Leaves: tap d joins t and t - d when both are in t's leaf and its document.
    pos = jnp.arange(total)
    y = x * h[..., 0]
    for d in range(1, leaf):
        shifted = jnp.pad(x[:total - d], [(d, 0)] + [(0, 0)] * (x.ndim - 1))
        same = (pos % leaf >= d) & (jnp.pad(seg[:total - d], (d, 0)) == seg)
        y = y + _mask(same, shifted) * h[..., d]

    m = leaf
    while m < total:
        blocks = total // (2 * m)
        xb = x.reshape(blocks, 2 * m, *x.shape[1:])
        sb = seg.reshape(blocks, 2 * m)
        crossing = sb[:, m - 1:m] == sb  # [blocks, 2m]: the document holding position m - 1
        left = _mask(crossing[:, :m], xb[:, :m])
        hf = jnp.fft.rfft(jnp.moveaxis(h[..., :2 * m], -1, 0), n=2 * m, axis=0)
        z = jnp.fft.irfft(jnp.fft.rfft(left, n=2 * m, axis=1) * hf, n=2 * m, axis=1)[:, m:]
        z = _mask(crossing[:, m:], z)
        z = jnp.pad(z, [(0, 0), (m, 0)] + [(0, 0)] * (z.ndim - 2))
        y = y + z.reshape(total, *z.shape[2:])
        m *= 2
    return y[:length]


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


def document_starts(segment_ids, length):
    """``bool[L]``: where a document starts (a recurrence restarts): every position whose id
    differs from the one before; all False without segment ids."""
    if segment_ids is None:
        return jnp.zeros((length,), bool)
    return jnp.concatenate([jnp.zeros((1,), bool), segment_ids[1:] != segment_ids[:-1]])
