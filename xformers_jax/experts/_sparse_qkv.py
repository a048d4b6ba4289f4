"""Scaling Transformers' sparse QKV (Jaszczur et al., 2021, "Sparse is Enough in Scaling
Transformers", section 3.2): the dense Q, K, V projections replaced by a multiplicative layer
followed by convolutions.

The model width ``d`` is split into ``S`` modules of ``M = d / S`` units.

* Multiplicative layer (shared by Q, K, V): ``z[s, m] = sum_i x_i D[i, s] E[i, m] + b[s, m]``
  with ``D [d, S]``, ``E [d, M]``: ``d (S + M)`` parameters instead of ``d^2``, yet it can
  express any permutation of the input.
* Each of Q, K, V is a 2-D convolution of ``z`` seen as an image of ``L`` rows (the sequence)
  by ``S`` columns (the modules) with ``M`` channels: ``W [F_len, F_mod, M, M]``, causal along
  the sequence (output row ``t`` reads rows ``t - F_len + 1 .. t``, zeros before the start) and
  centred along the modules (zero padding ``(F_mod - 1) / 2`` each side), plus a bias ``[M]``.
  Q and K use ``F_mod = 3``, V uses ``F_mod = 1`` (the paper's and trax's
  ``MultiplicativeConvCausalAttention`` sizes; trax also concatenates the input to V's
  convolution input, which this form leaves out). ``F_len = 3`` by default.

Every output row depends only on the same and earlier positions, so the projections are
causal-safe; padded positions' ``z`` is zeroed before the convolution, so later real positions
read zeros there (the layers pass ``mask``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def multiplicative_dense(x, d_mult, e_mult, bias=None):
    """``x [..., d]``, ``d_mult [d, S]``, ``e_mult [d, M]`` (``bias [S, M]``) ->
    ``z [..., S, M]`` with ``z[s, m] = sum_i x_i D[i, s] E[i, m] (+ b[s, m])``."""
    if d_mult.ndim != 2 or e_mult.ndim != 2 or d_mult.shape[0] != x.shape[-1] or \
            e_mult.shape[0] != x.shape[-1]:
        raise ValueError(f"multiplicative_dense: need x [..., d], D [d, S], E [d, M]; got "
                         f"{x.shape}, {d_mult.shape}, {e_mult.shape}")
    z = jnp.einsum("...i,is,im->...sm", x, d_mult.astype(x.dtype), e_mult.astype(x.dtype))
    return z if bias is None else z + bias.astype(x.dtype)


def module_conv(z, kernel, bias=None):
    """The causal-in-length, centred-in-modules convolution: ``z [B, L, S, M]``, ``kernel
    [F_len, F_mod, M, M_out]`` (``F_mod`` odd), ``bias [M_out]`` -> ``[B, L, S, M_out]``."""
    if (z.ndim != 4 or kernel.ndim != 4 or kernel.shape[2] != z.shape[-1]
            or kernel.shape[1] % 2 == 0):
        raise ValueError(f"module_conv: need z [B, L, S, M] and kernel [F_len, F_mod (odd), M, "
                         f"M_out]; got {z.shape}, {kernel.shape}")
    f_len, f_mod = kernel.shape[:2]
    half = (f_mod - 1) // 2
    out = jax.lax.conv_general_dilated(
        z, kernel.astype(z.dtype), window_strides=(1, 1),
        padding=((f_len - 1, 0), (half, half)), dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return out if bias is None else out + bias.astype(z.dtype)


def sparse_qkv(x, d_mult, e_mult, b_mult, kernels, biases, *, mask=None):
    """``x [B, L, d]`` -> ``(q, k, v)``, each ``[B, L, d]`` (modules flattened ``s * M + m``):
    one shared :func:`multiplicative_dense`, then :func:`module_conv` with ``kernels[i]``
    and ``biases[i]`` for Q, K, V. ``mask bool[B, L]`` zeroes padded positions' ``z``."""
    b, length, d = x.shape
    z = multiplicative_dense(x, d_mult, e_mult, b_mult)
    if mask is not None:
        z = z * mask[:, :, None, None].astype(z.dtype)
    return tuple(module_conv(z, w, bb).reshape(b, length, d) for w, bb in zip(kernels, biases))
