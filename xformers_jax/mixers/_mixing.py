"""Token mixing without attention: MLP-Mixer, gMLP's spatial gating unit, FNet, PoolFormer and
lambda layers. Each function takes one sequence ``x: [L, D]`` and ``kv_mask: bool[L]``.

- MLP-Mixer (Tolstikhin et al. 2021, "MLP-Mixer: An all-MLP Architecture for Vision"): the
  token-mixing MLP, ``y[:, c] = W2 gelu(W1 x[:, c] + b1) + b2`` for every channel ``c``.
- gMLP (Liu, Dai, So and Le 2021, "Pay Attention to MLPs"): the spatial gating unit
  ``s(z) = z1 * (W z2 + b)`` with ``z = [z1, z2]`` split on channels, ``W`` near zero and
  ``b = 1`` at initialisation; causal with a lower-triangular ``W``.
- FNet (Lee-Thorp, Ainslie, Eckstein and Ontanon 2022, "FNet: Mixing Tokens with Fourier
  Transforms"): ``Re(FFT_seq(FFT_hidden(x)))``.
- PoolFormer (Yu et al. 2022, "MetaFormer Is Actually What You Need for Vision"): average
  pooling minus identity, ``AvgPool(x) - x``.
- Lambda layers (Bello 2021, "LambdaNetworks: Modeling Long-Range Interactions Without
  Attention"): a content lambda ``softmax(K)^T V`` shared by all queries plus position
  lambdas ``E_n^T V`` from relative position embeddings, applied as ``y_n = q_n^T (lambda^c +
  lambda^p_n)``; the local-context form restricts the position lambdas to ``|m - n| <= r``.

Padding: masked positions are zeroed before any mixing (and excluded from pools and softmax
normalisers). Length-sized weights (MLP-Mixer, gMLP) are sliced to the first ``L`` rows and
columns, and FNet transforms over a fixed ``max_len`` positions (the paper pads every input to
its maximum length), so neither the padding's content nor its amount changes a real output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..kernels import STATS_DTYPE


def _check_x(name, x, kv_mask):
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be [L, D], got shape {x.shape}")
    if kv_mask is not None:
        if kv_mask.shape != x.shape[:1]:
            raise ValueError(f"{name}: kv_mask must be bool[{x.shape[0]}], got shape "
                             f"{kv_mask.shape}")
        x = jnp.where(kv_mask[:, None], x, jnp.zeros((), x.dtype))
    return x


def _check_len(name, length, max_len):
    if length > max_len:
        raise ValueError(f"{name}: sequence length {length} exceeds the {max_len} positions its "
                         "length-sized weights were built for (max_len)")


def token_mixing_mlp(x, w1, b1, w2, b2, *, kv_mask=None):
    """MLP-Mixer's token-mixing MLP over one sequence.

    Args:
      x: ``[L, D]``. w1: ``[T, max_len]``, b1: ``[T]``, w2: ``[max_len, T]``, b2:
        ``[max_len]`` (sliced to the first ``L`` positions). kv_mask: ``bool[L]``.

    Returns:
      ``[L, D]``.
    """
    name = "token_mixing_mlp"
    x = _check_x(name, x, kv_mask)
    length = x.shape[0]
    _check_len(name, length, w1.shape[1])
    h = jax.nn.gelu(w1[:, :length].astype(x.dtype) @ x + b1[:, None].astype(x.dtype))
    return w2[:length].astype(x.dtype) @ h + b2[:length, None].astype(x.dtype)


def spatial_gating(z, w, b, *, causal: bool = False, kv_mask=None, extra=None):
    """gMLP's spatial gating unit ``z1 * (W z2 + b (+ extra))``.

    Args:
      z: ``[L, 2 E]`` (its second half is ``z2``, already normalised by the caller).
      w: ``[max_len, max_len]``, b: ``[max_len]``. causal: keep ``W``'s lower triangle.
      kv_mask: ``bool[L]``. extra: ``[L, E]`` added to the gate (aMLP's tiny attention).

    Returns:
      ``[L, E]``.
    """
    name = "spatial_gating"
    z = _check_x(name, z, kv_mask)
    length, two_e = z.shape
    if two_e % 2:
        raise ValueError(f"spatial_gating: z's channels must split in two halves, got {two_e}")
    _check_len(name, length, w.shape[0])
    z1, z2 = z[:, : two_e // 2], z[:, two_e // 2:]
    w = w[:length, :length].astype(z.dtype)
    if causal:
        w = jnp.tril(w)
    gate = w @ z2 + b[:length, None].astype(z.dtype)
    if extra is not None:
        gate = gate + extra
    return z1 * gate


def fourier_mixing(x, *, max_len: int | None = None, kv_mask=None):
    """FNet's mixing ``Re(FFT2(x))`` over (positions, channels).

    The transform runs over ``max_len`` positions (zeros after the sequence, as FNet pads its
    inputs to the maximum length), so a real output depends on neither the padding's content
    (zeroed by ``kv_mask``) nor its amount. ``max_len=None`` transforms over ``L``.

    Returns ``[L, D]`` in x's dtype (the FFT runs in float32).
    """
    name = "fourier_mixing"
    x = _check_x(name, x, kv_mask)
    length = x.shape[0]
    n = length if max_len is None else max_len
    _check_len(name, length, n)
    y = jnp.fft.fft2(x.astype(jnp.float32), s=(n, x.shape[1]))[:length].real
    return y.astype(x.dtype)


def pool_mixing(x, *, pool_size: int = 3, kv_mask=None):
    """PoolFormer's ``AvgPool(x) - x`` with a centred window of ``pool_size`` (odd) positions,
    averaging over the real positions only (``count_include_pad=False``).

    Returns ``[L, D]``.
    """
    name = "pool_mixing"
    if pool_size < 1 or pool_size % 2 == 0:
        raise ValueError(f"pool_mixing: pool_size must be a positive odd int, got {pool_size}")
    x = _check_x(name, x, kv_mask)
    length = x.shape[0]
    real = jnp.ones((length,), x.dtype) if kv_mask is None else kv_mask.astype(x.dtype)
    r = pool_size // 2
    xp = jnp.pad(x, ((r, r), (0, 0)))
    mp = jnp.pad(real, (r, r))
    total = sum(xp[i: i + length] for i in range(pool_size))
    count = sum(mp[i: i + length] for i in range(pool_size))
    return total / jnp.maximum(count, 1)[:, None] - x


def lambda_mixing(q, k, v, rel, *, window: int | None = None, kv_mask=None):
    """A lambda layer over one sequence (Bello 2021, Eq. 2-3 and Fig. 3).

    Args:
      q: ``[L, H, K]`` queries (``H`` heads share the lambdas). k: ``[L, K]`` keys
        (normalised by a softmax over positions). v: ``[L, V]`` values.
      rel: ``[2 R + 1, K]`` relative position embeddings ``E_{m - n}`` for ``|m - n| <= R``.
      window: the local-context radius (``None``: global, ``R >= L - 1`` needed).
      kv_mask: ``bool[L]``: padded positions are out of the softmax and the lambdas.

    Returns:
      ``[L, H, V]``: ``y_nh = q_nh^T (lambda^c + lambda^p_n)``.
    """
    name = "lambda_mixing"
    if q.ndim != 3 or k.ndim != 2 or v.ndim != 2 or k.shape != (q.shape[0], q.shape[2]) or \
            v.shape[0] != q.shape[0]:
        raise ValueError(f"lambda_mixing: need q [L, H, K], k [L, K], v [L, V]; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    length = q.shape[0]
    radius = (rel.shape[0] - 1) // 2
    if rel.ndim != 2 or rel.shape[0] % 2 == 0 or rel.shape[1] != q.shape[2]:
        raise ValueError(f"lambda_mixing: rel must be [2 R + 1, K={q.shape[2]}], got {rel.shape}")
    r = radius if window is None else window
    if window is None and radius < length - 1:
        raise ValueError(f"lambda_mixing: global position lambdas need R >= L - 1 = "
                         f"{length - 1} relative embeddings each side, got R = {radius}")
    if r > radius:
        raise ValueError(f"lambda_mixing: window {r} exceeds the {radius} relative embeddings")
    real = jnp.ones((length,), bool) if kv_mask is None else kv_mask
    if real.shape != (length,):
        raise ValueError(f"lambda_mixing: kv_mask must be bool[{length}], got {real.shape}")
    f32 = STATS_DTYPE
    v = jnp.where(real[:, None], v.astype(f32), 0)
    logits = jnp.where(real[:, None], k.astype(f32), -jnp.inf)
    content = jnp.einsum("mk,mv->kv", jax.nn.softmax(logits, axis=0), v)
    offsets = jnp.arange(length)[None, :] - jnp.arange(length)[:, None]  # m - n
    keep = (jnp.abs(offsets) <= r) & real[None, :]
    e = rel.astype(f32)[jnp.clip(offsets, -radius, radius) + radius]  # [n, m, K]
    position = jnp.einsum("nmk,mv->nkv", jnp.where(keep[..., None], e, 0), v)
    y = jnp.einsum("nhk,kv->nhv", q.astype(f32), content)
    y = y + jnp.einsum("nhk,nkv->nhv", q.astype(f32), position)
    return y.astype(q.dtype)
