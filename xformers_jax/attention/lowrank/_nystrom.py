"""Nyströmformer: attention through segment-mean landmarks and an iterative pseudo-inverse.

Xiong et al., "Nyströmformer: A Nyström-Based Algorithm for Approximating Self-Attention"
(2021): ``softmax(Q K~^T) Z softmax(Q~ K^T) V`` with ``Z ~ softmax(Q~ K~^T)^+``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._dense import dot_product_attention


def segment_means(x, num_segments: int, mask=None):
    """Means of ``num_segments`` contiguous, near-equal segments of the rows of ``x [L, D]``.

    Only rows where ``mask`` is True count, and segments are cut over those rows alone, so a
    padded sequence gives the landmarks of its unpadded prefix. ``L`` need not be divisible
    by ``num_segments``. Returns ``(means [m, D] float32, valid bool[m])``; a segment with no
    row (fewer real rows than segments) is invalid and its mean is zero.
    """
    length = x.shape[0]
    if mask is None:
        mask = jnp.ones((length,), bool)
    rank = jnp.cumsum(mask) - 1
    count = jnp.maximum(jnp.sum(mask), 1)
    seg = jnp.where(mask, (rank * num_segments) // count, num_segments)
    weight = mask.astype(C.STATS_DTYPE)
    sums = jax.ops.segment_sum(x.astype(C.STATS_DTYPE) * weight[:, None], seg,
                               num_segments=num_segments + 1)[:num_segments]
    sizes = jax.ops.segment_sum(weight, seg, num_segments=num_segments + 1)[:num_segments]
    return sums / jnp.maximum(sizes, 1.0)[:, None], sizes > 0


def iterative_pinv(a, iterations: int):
    """Moore-Penrose pseudo-inverse of ``a [m, m]`` by the Nyströmformer's iteration.

    ``Z_0 = a^T / (||a||_1 ||a||_inf)`` (the paper's initialisation, which makes the iteration
    converge to ``a^+``), then ``Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4`` with
    ``A Z = a Z``. Computed in float32.
    """
    a = a.astype(C.STATS_DTYPE)
    eye = jnp.eye(a.shape[0], dtype=a.dtype)
    norm1 = jnp.max(jnp.sum(jnp.abs(a), axis=0))
    norm_inf = jnp.max(jnp.sum(jnp.abs(a), axis=1))
    z = a.T / jnp.maximum(norm1 * norm_inf, jnp.finfo(a.dtype).tiny)

    def step(z, _):
        az = a @ z
        return 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az))), None

    return jax.lax.scan(step, z, None, length=iterations)[0]


def depthwise_conv_skip(v, weight):
    """The Nyströmformer's residual ``conv(V)``: one kernel ``weight [K]`` (odd K) slid along
    the length of every channel of ``v [L, Dv]``, zero-padded to keep the length."""
    # A sum of shifted copies rather than lax.conv: under vmap over heads a per-head kernel
    # turns lax.conv into a grouped convolution that XLA:CPU runs ~50x slower.
    size, length = weight.shape[0], v.shape[0]
    padded = jnp.pad(v.astype(C.STATS_DTYPE), ((size // 2, size // 2), (0, 0)))
    weight = weight.astype(C.STATS_DTYPE)
    return sum(weight[i] * padded[i : i + length] for i in range(size))


def init_nystrom_conv(key, kernel_size: int = 33, *, dtype=jnp.float32):
    """A depthwise conv kernel ``[kernel_size]`` for :func:`nystrom_attention`'s skip on V,
    ``N(0, 1/kernel_size)``."""
    kernel_size = C.check_positive_int("init_nystrom_conv", "kernel_size", kernel_size)
    if kernel_size % 2 == 0:
        raise ValueError(f"init_nystrom_conv: kernel_size must be odd but got {kernel_size}")
    return (kernel_size ** -0.5 * jax.random.normal(key, (kernel_size,))).astype(dtype)


def nystrom_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    conv_weight=None,
    *,
    num_landmarks: int,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    q_mask: Bool[Array, "q_seq"] | None = None,
    scale: float | None = None,
    pinv_iterations: int = 6,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Nyströmformer attention for one sequence and one head.

    Landmarks ``Q~, K~`` (``[m, Dk]``) are segment means of the real queries and keys; the
    three softmax kernels are exact softmax attention (:func:`dot_product_attention`) between
    (queries, key landmarks), (query landmarks, key landmarks) and (query landmarks, keys); the
    middle one is inverted with :func:`iterative_pinv` in float32. With as many landmarks as
    tokens (and enough iterations) this is exact softmax attention.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``. Lengths need not be multiples of m.
      conv_weight: optional ``[K]`` depthwise conv kernel (odd K, see
        :func:`init_nystrom_conv`); adds ``conv(V)`` (the paper's skip), needs ``Lq == Lk``.
      num_landmarks: ``m``.
      causal: unsupported; raises ``NotImplementedError``.
      kv_mask: ``bool[Lk]``; masked keys are left out of the landmarks and the attention.
      q_mask: ``bool[Lq]``, True for real queries (default: ``kv_mask`` when ``Lq == Lk``);
        masked queries are left out of the query landmarks and their outputs are zeros.
      scale: score scale, ``1/sqrt(Dk)`` by default.
      pinv_iterations: iterations of the pseudo-inverse (6 in the paper).

    Returns:
      ``[Lq, Dv]`` in q's dtype.
    """
    name = "nystrom_attention"
    if causal:
        C.causal_unsupported(
            name, "each landmark is a mean over a segment of the whole sequence, so every "
            "output depends on future tokens"
        )
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    q_mask = C.check_q_mask(name, q_mask, kv_mask, x.lq, x.lk)
    m = C.check_positive_int(name, "num_landmarks", num_landmarks)
    iterations = C.check_positive_int(name, "pinv_iterations", pinv_iterations)
    if conv_weight is not None:
        conv_weight = jnp.asarray(conv_weight)
        if conv_weight.ndim != 1 or conv_weight.shape[0] % 2 == 0:
            raise ValueError(
                f"{name}: conv_weight must be one odd-length kernel [K] but got shape "
                f"{conv_weight.shape}"
            )
        if x.lq != x.lk:
            raise ValueError(
                f"{name}: the conv skip on V adds conv(V) [Lk, Dv] to the output [Lq, Dv], so it "
                f"needs Lq == Lk but got q{tuple(x.q.shape)}, v{tuple(x.v.shape)}"
            )
    scale = C.resolve_scale(x.dk, scale)
    f32 = C.STATS_DTYPE
    q32, k32, v32 = x.q.astype(f32), x.k.astype(f32), x.v.astype(f32)
    q_lm, q_valid = segment_means(q32, m, q_mask)
    k_lm, k_valid = segment_means(k32, m, kv_mask)

    # softmax(Q~ K^T) V, with invalid landmark rows zeroed.
    kernel3_v = dot_product_attention(q_lm, k32, v32, kv_mask=kv_mask, scale=scale)
    kernel3_v = jnp.where(q_valid[:, None], kernel3_v, 0.0)
    _, kernel2 = dot_product_attention(q_lm, k_lm, k_lm, kv_mask=k_valid, scale=scale,
                                       return_weights=True)
    kernel2 = jnp.where(q_valid[:, None], kernel2, 0.0)
    mixed = iterative_pinv(kernel2, iterations) @ kernel3_v
    out = dot_product_attention(q32, k_lm, mixed, kv_mask=k_valid, scale=scale)
    if conv_weight is not None:
        masked_v = v32 if kv_mask is None else jnp.where(kv_mask[:, None], v32, 0.0)
        out = out + depthwise_conv_skip(masked_v, conv_weight)
    return C.zero_masked_rows(out.astype(x.q.dtype), q_mask)
