"""Sparse replacements of softmax: sparsemax, 1.5-entmax and alpha-entmax, and their attention.

Correia, Niculae & Martins, "Adaptively Sparse Transformers" (EMNLP 2019); Peters, Niculae &
Martins, "Sparse Sequence-to-Sequence Models" (ACL 2019); Martins & Astudillo, "From Softmax to
Sparsemax" (ICML 2016). Equation numbers below are those of Fournier et al. (2021, "A
Practical Survey on Faster and Lighter Transformers", Eq. 16-19).

alpha-entmax(z) = [(alpha - 1) z - tau]_+ ^ (1 / (alpha - 1)) with tau making it sum to one
(Eq 18): alpha = 1 is softmax, alpha = 2 sparsemax, alpha = 1.5 has an exact sort-based
solution. Every map has a custom VJP: differentiating through the sort gives NaN where inputs
are masked with -inf, and the closed-form Jacobians are cheaper anyway. Masked entries (a
boolean ``mask``, or -inf scores) get exactly zero probability and zero gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C

# Below this alpha - 1, alpha-entmax is computed as softmax (its limit): the power
# 1 / (alpha - 1) is then too large for float32 bisection.
_SOFTMAX_BELOW = 1e-3


def _prepare(z, mask):
    z = jnp.asarray(z, jnp.float32)
    real = jnp.isfinite(z) if mask is None else (jnp.asarray(mask) & jnp.isfinite(z))
    return z, jnp.broadcast_to(real, z.shape)


def _sorted_stats(x, real):
    """Valid entries sorted descending (padding 0 after them) and the rank mask ``k <= n``."""
    xs = -jnp.sort(-jnp.where(real, x, -jnp.inf), axis=-1)
    ranks = jnp.arange(1, x.shape[-1] + 1, dtype=jnp.float32)
    in_range = ranks <= real.sum(-1, keepdims=True)
    return jnp.where(in_range, xs, 0.0), ranks, in_range


def _at_support(values, support):
    idx = jnp.maximum(support.astype(jnp.int32) - 1, 0)
    return jnp.take_along_axis(values, idx, axis=-1)


def _simplex_vjp(p, gppr, g):
    """The entmax Jacobian-vector product: ``gppr * (g - <gppr, g> / sum(gppr))``."""
    dz = g * gppr
    total = gppr.sum(-1, keepdims=True)
    return dz - gppr * dz.sum(-1, keepdims=True) / jnp.where(total > 0, total, 1.0)


@jax.custom_vjp
def _sparsemax(z, real):
    zs, ranks, in_range = _sorted_stats(z, real)
    cs = jnp.cumsum(zs, axis=-1)
    support = jnp.sum(in_range & (1.0 + ranks * zs > cs), axis=-1, keepdims=True)
    tau = (_at_support(cs, support) - 1.0) / jnp.maximum(support, 1)
    return jnp.where(real, jnp.maximum(jnp.where(real, z, 0.0) - tau, 0.0), 0.0)


def _sparsemax_fwd(z, real):
    p = _sparsemax(z, real)
    return p, p


def _sparsemax_bwd(p, g):
    return _simplex_vjp(p, (p > 0).astype(p.dtype), g), None


_sparsemax.defvjp(_sparsemax_fwd, _sparsemax_bwd)


@jax.custom_vjp
def _entmax15(z, real):
    top = jnp.max(jnp.where(real, z, -jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(real, z - jnp.where(jnp.isfinite(top), top, 0.0), 0.0) / 2.0
    xs, ranks, in_range = _sorted_stats(x, real)
    mean = jnp.cumsum(xs, axis=-1) / ranks
    mean_sq = jnp.cumsum(xs * xs, axis=-1) / ranks
    delta = (1.0 - ranks * (mean_sq - mean * mean)) / ranks
    tau = mean - jnp.sqrt(jnp.maximum(delta, 0.0))
    support = jnp.sum(in_range & (tau <= xs), axis=-1, keepdims=True)
    tau_star = _at_support(tau, support)
    return jnp.where(real, jnp.maximum(x - tau_star, 0.0) ** 2, 0.0)


def _entmax15_fwd(z, real):
    p = _entmax15(z, real)
    return p, p


def _entmax15_bwd(p, g):
    return _simplex_vjp(p, jnp.sqrt(p), g), None


_entmax15.defvjp(_entmax15_fwd, _entmax15_bwd)


def _power(y, exponent):
    """``y ** exponent`` for ``y >= 0``, 0 at 0, with finite gradients everywhere."""
    pos = y > 0
    return jnp.where(pos, jnp.exp(exponent * jnp.log(jnp.where(pos, y, 1.0))), 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _bisect(z, alpha, real, n_iter):
    am1 = alpha - 1.0
    x = jnp.where(real, z, 0.0) * am1
    top = jnp.max(jnp.where(real, x, -jnp.inf), axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    n = jnp.maximum(real.sum(-1, keepdims=True), 1).astype(jnp.float32)
    lo = top - 1.0  # there the largest entry alone has mass 1: the sum is >= 1
    width = (top - n ** -am1) - lo  # there every entry has mass <= 1/n: the sum is <= 1

    def mass(tau):
        return jnp.where(real, _power(jnp.maximum(x - tau, 0.0), 1.0 / am1), 0.0)

    def step(_, carry):
        lo, width = carry
        width = width / 2.0
        mid = lo + width
        lo = jnp.where(mass(mid).sum(-1, keepdims=True) >= 1.0, mid, lo)
        return lo, width

    lo, width = jax.lax.fori_loop(0, n_iter, step, (lo, width))
    p = mass(lo + width / 2.0)
    total = p.sum(-1, keepdims=True)
    return p / jnp.where(total > 0, total, 1.0)


def _bisect_fwd(z, alpha, real, n_iter):
    p = _bisect(z, alpha, real, n_iter)
    return p, (p, alpha)


def _bisect_bwd(n_iter, res, g):
    p, alpha = res
    gppr = _power(p, 2.0 - alpha)
    dz = _simplex_vjp(p, gppr, g)
    # d p / d alpha (Correia et al. 2019, Appendix; the entmax package's EntmaxBisectFunction).
    am1 = alpha - 1.0
    plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
    ent = plogp.sum(-1, keepdims=True)
    total = gppr.sum(-1, keepdims=True)
    skewed = gppr / jnp.where(total > 0, total, 1.0)
    d_alpha = g * (p - skewed) / am1**2 - g * (plogp - skewed * ent) / am1
    return dz, jnp.sum(d_alpha).astype(alpha.dtype).reshape(alpha.shape), None


_bisect.defvjp(_bisect_fwd, _bisect_bwd)


def sparsemax(z, mask=None):
    """Sparsemax over the last axis (alpha = 2): the Euclidean projection onto the simplex.

    Exact, sort-based. ``mask`` (bool, broadcastable to ``z``) or -inf entries get exactly
    zero. A row with no real entry gives zeros. Returns float32.
    """
    return _sparsemax(*_prepare(z, mask))


def entmax15(z, mask=None):
    """1.5-entmax over the last axis, exact and sort-based (Peters et al. 2019, Alg. 2).

    ``[z/2 - tau]_+^2`` summing to one. Masking as :func:`sparsemax`. Returns float32.
    """
    return _entmax15(*_prepare(z, mask))


def entmax_bisect(z, alpha, mask=None, *, n_iter: int = 50):
    """alpha-entmax over the last axis for any ``alpha >= 1`` (Eq 18), by bisection on tau.

    ``alpha`` is a float or a scalar array (learnable: its gradient is exact, not through the
    iterations). ``alpha - 1 < 1e-3`` is computed as softmax, the alpha -> 1 limit. Masking as
    :func:`sparsemax`. Returns float32.
    """
    z, real = _prepare(z, mask)
    n_iter = C.check_positive_int("entmax_bisect", "n_iter", n_iter)
    alpha = jnp.asarray(alpha, jnp.float32)
    if alpha.ndim:
        raise ValueError(f"entmax_bisect: alpha must be a scalar but has shape {alpha.shape}")
    near_one = alpha - 1.0 < _SOFTMAX_BELOW
    # The bisection branch must stay finite (gradients included) when softmax is selected.
    p = _bisect(z, jnp.where(near_one, 1.5, alpha), real, n_iter)
    zs = jnp.where(real, z, -jnp.inf)
    top = jnp.max(zs, axis=-1, keepdims=True)
    e = jnp.where(real, jnp.exp(zs - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    soft = e / jnp.maximum(e.sum(-1, keepdims=True), 1e-30)
    return jnp.where(near_one, soft, p)


def entmax_alpha(a):
    """The per-head alpha of the Adaptively Sparse Transformer, ``1 + sigmoid(a)`` (Eq 19)."""
    return 1.0 + jax.nn.sigmoid(a)


def entmax_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    alpha=1.5,
    *,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale: float | None = None,
    n_iter: int = 50,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Attention whose weights are alpha-entmax of the scores (exactly sparse for alpha > 1).

    ``alpha`` as a Python number picks the exact map: 1 softmax, 1.5 :func:`entmax15`, 2
    :func:`sparsemax`, else :func:`entmax_bisect`; as an array (e.g. ``entmax_alpha(a)`` for a
    learnable per-head ``a``, mapped over heads with ``multihead(..., arg_axes=("heads",))``)
    it always uses the bisection, with the exact gradient for alpha. The score matrix is dense,
    O(Lq * Lk): sparsity here is in the weights, not the cost (Correia et al., 2019).

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      alpha: the entmax parameter (>= 1).
      causal: query i sees keys j <= i only.
      kv_mask: ``bool[Lk]``, True for real keys.
      segment_ids: packed-sequence ids ``int[L]`` or a ``(q, kv)`` pair: a query's entmax
        runs over its own document's keys.
      scale: score scale, ``1/sqrt(Dk)`` by default.
      n_iter: bisection steps (array or non-special alpha).

    Returns:
      ``[Lq, Dv]`` in q's dtype.
    """
    name = "entmax_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    scale = C.resolve_scale(x.dk, scale)
    if isinstance(alpha, (int, float)) and alpha < 1:
        raise ValueError(f"{name}: alpha must be >= 1 but got {alpha}")
    s = jnp.einsum("qd,kd->qk", x.q, x.k, preferred_element_type=C.STATS_DTYPE) * scale
    real = jnp.ones(s.shape, bool)
    if kv_mask is not None:
        real = real & kv_mask[None, :]
    if causal:
        real = real & jnp.tril(jnp.ones(s.shape, bool))
    segs = C.check_segment_ids(name, segment_ids, x.lq, x.lk)
    if segs is not None:
        real = real & (segs[0][:, None] == segs[1][None, :])
    if isinstance(alpha, (int, float)) and alpha == 1:
        p = entmax_bisect(s, 1.0, real)
    elif isinstance(alpha, (int, float)) and alpha == 1.5:
        p = entmax15(s, real)
    elif isinstance(alpha, (int, float)) and alpha == 2:
        p = sparsemax(s, real)
    else:
        p = entmax_bisect(s, alpha, real, n_iter=n_iter)
    out = jnp.einsum("qk,kd->qd", p.astype(x.v.dtype), x.v, preferred_element_type=C.STATS_DTYPE)
    return out.astype(x.q.dtype)
