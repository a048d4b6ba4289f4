"""Feature maps phi for kernelized (linear) attention, and the random projections they draw.

``sim(q, k) = phi(q) . phi(k)`` replaces ``exp(q . k)`` (Katharopoulos et al., 2020;
Choromanski et al., 2021). Each public map takes ``x: [L, D]`` and returns float32 features
``[L, M]``.

The exponential maps (FAVOR+ positive, hyperbolic) are also registered in *log space*:
:func:`~xformers_jax.attention.linear_attention` receives ``log phi`` and stabilises it itself,
because a stabiliser that is right for queries (a per-row maximum, which cancels in the
normalisation) is wrong for keys (a per-key shift reweights the keys) and a key maximum taken
over the whole sequence leaks the future under ``causal=True``. See ``_linear`` for how keys
are stabilised.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from .._contract import STATS_DTYPE, check_positive_int


def _f32(x) -> jax.Array:
    return jnp.asarray(x).astype(STATS_DTYPE)


def _check_projection(name: str, x, projection) -> jax.Array:
    projection = jnp.asarray(projection)
    if projection.ndim != 2 or projection.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{name}: projection must have shape [num_features, D] with D = {x.shape[-1]} "
            f"(the last dimension of x{tuple(x.shape)}) but got {tuple(projection.shape)}"
        )
    return _f32(projection)


def _half_sq_norm(x: jax.Array) -> jax.Array:
    return 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)


def elu_features(x) -> jax.Array:
    """``phi(x) = elu(x) + 1`` (Linear Transformer; Katharopoulos et al., 2020).

    Args:
      x: ``[L, D]``.

    Returns:
      ``[L, D]`` positive float32 features.
    """
    return jax.nn.elu(_f32(x)) + 1.0


def relu_features(x, projection=None) -> jax.Array:
    """``relu(x)``, or Performer's ReLU kernel ``relu(x W^T) / sqrt(M)`` given a projection.

    The projected form approximates the order-1 arc-cosine kernel (Choromanski et al., 2021;
    Peng et al., 2021; ``h = 1``, ``f = ReLU`` in the general random feature map of Lin et al.,
    2022, "A Survey of Transformers", Eq. 17).

    Args:
      x: ``[L, D]``.
      projection: optional ``[M, D]`` random projection from :func:`init_random_projection`.

    Returns:
      ``[L, D]`` (or ``[L, M]``) non-negative float32 features.
    """
    x = _f32(x)
    if projection is None:
        return jax.nn.relu(x)
    w = _check_projection("relu_features", x, projection)
    return jax.nn.relu(x @ w.T) / math.sqrt(w.shape[0])


def _favor_positive_log(x, projection) -> jax.Array:
    x = _f32(x)
    w = _check_projection("favor_positive_features", x, projection)
    return x @ w.T - _half_sq_norm(x) - 0.5 * math.log(w.shape[0])


def favor_positive_features(x, projection) -> jax.Array:
    """FAVOR+ positive random features ``exp(W x - |x|^2 / 2) / sqrt(M)``.

    ``E[phi(q) . phi(k)] = exp(q . k)`` for Gaussian rows of ``W``; orthogonal rows lower the
    variance (Choromanski et al., 2021; ``h(x) = exp(-|x|^2/2)``, ``f = exp`` in Lin et al.,
    2022, Eq. 17). This public function is unstabilised; ``linear_attention`` and
    ``performer_attention`` use the log-space form and stabilise it without leaking the future.

    Args:
      x: ``[L, D]`` (already multiplied by ``scale ** 0.5`` to approximate
        ``exp(scale q . k)``).
      projection: ``[M, D]`` from :func:`init_random_projection`.

    Returns:
      ``[L, M]`` positive float32 features.
    """
    return jnp.exp(_favor_positive_log(x, projection))


def _hyperbolic_log(x, projection) -> jax.Array:
    x = _f32(x)
    w = _check_projection("hyperbolic_features", x, projection)
    wx = x @ w.T
    return jnp.concatenate([wx, -wx], axis=-1) - _half_sq_norm(x) - 0.5 * math.log(2 * w.shape[0])


def hyperbolic_features(x, projection) -> jax.Array:
    """Hyperbolic positive features ``exp(-|x|^2/2) / sqrt(2M) [exp(W x), exp(-W x)]``.

    Choromanski et al. (2021), in the form of Fournier et al. (2021, "A Practical Survey on
    Faster and Lighter Transformers", Eq. 35): the antithetic pair makes the estimate of
    ``exp(q . k)`` lower-variance than FAVOR+ at the cost of twice the features.

    Args:
      x: ``[L, D]``.
      projection: ``[M, D]`` from :func:`init_random_projection`.

    Returns:
      ``[L, 2M]`` positive float32 features.
    """
    return jnp.exp(_hyperbolic_log(x, projection))


def favor_trig_features(x, projection) -> jax.Array:
    """FAVOR trigonometric features ``exp(|x|^2/2) / sqrt(M) [sin(W x), cos(W x)]``.

    The first Performer (Choromanski et al., 2020; random Fourier features, Rahimi & Recht,
    2007): ``E[phi(q) . phi(k)] = exp(q . k)`` because
    ``exp(q . k) = exp(|q|^2/2) exp(|k|^2/2) exp(-|q - k|^2/2)``. Lin et al. (2022, "A Survey of
    Transformers", text after Eq. 17) print ``h(x) = exp(-|x|^2/2)``; the sign must be ``+``
    for the identity to hold. Features can be negative, so the attention denominator can
    vanish: ``linear_attention`` guards it.

    Args:
      x: ``[L, D]``.
      projection: ``[M, D]`` from :func:`init_random_projection`.

    Returns:
      ``[L, 2M]`` float32 features.
    """
    x = _f32(x)
    w = _check_projection("favor_trig_features", x, projection)
    wx = x @ w.T
    h = jnp.exp(_half_sq_norm(x)) / math.sqrt(w.shape[0])
    return h * jnp.concatenate([jnp.sin(wx), jnp.cos(wx)], axis=-1)


def rfa_features(x, projection) -> jax.Array:
    """Random Feature Attention features ``[sin(W x'), cos(W x')] / sqrt(M)``, ``x' = x/|x|``.

    Peng et al., 2021, "Random Feature Attention": on l2-normalised inputs the Gaussian kernel
    ``exp(-|q' - k'|^2 / (2 sigma^2))`` is proportional to ``exp(q' . k' / sigma^2)``, so
    ``h(x) = 1``. ``sigma`` lives in the projection (:func:`init_rfa_projection`).

    Args:
      x: ``[L, D]``.
      projection: ``[M, D]``.

    Returns:
      ``[L, 2M]`` float32 features.
    """
    x = _f32(x)
    w = _check_projection("rfa_features", x, projection)
    norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    wx = (x / jnp.where(norm == 0, 1.0, norm)) @ w.T
    return jnp.concatenate([jnp.sin(wx), jnp.cos(wx)], axis=-1) / math.sqrt(w.shape[0])


def dpfp_features(x, nu: int = 1) -> jax.Array:
    """Deterministic parameter-free projection (Schlag et al., 2021; indexed as in Lin et al.,
    2022, "A Survey of Transformers", Eq. 18).

    ``phi_{i + 2(j-1)D}(x) = r_i r_{i+j}`` for ``r = relu([x, -x])``, ``i = 1..2D``,
    ``j = 1..nu`` (indices modulo 2D).

    Args:
      x: ``[L, D]``.
      nu: number of shifted products (capacity ``2 nu D``).

    Returns:
      ``[L, 2 nu D]`` non-negative float32 features.
    """
    nu = check_positive_int("dpfp_features", "nu", nu)
    x = _f32(x)
    r = jax.nn.relu(jnp.concatenate([x, -x], axis=-1))
    if nu > r.shape[-1]:
        raise ValueError(f"dpfp_features: nu={nu} must be at most 2D = {r.shape[-1]}")
    return jnp.concatenate([r * jnp.roll(r, -j, axis=-1) for j in range(1, nu + 1)], axis=-1)


def init_random_projection(
    key, num_features: int, dim: int, *, orthogonal: bool = True, scaling: str = "chi"
) -> jax.Array:
    """Draws a ``[num_features, dim]`` Gaussian projection for the random feature maps.

    Orthogonal random features (Choromanski et al., 2021): stacked
    ``dim x dim`` blocks with orthonormal rows (QR of Gaussian matrices), then rescaled so each
    row has the norm of a Gaussian vector. ``scaling="chi"`` draws those norms from the chi
    distribution with ``dim`` degrees of freedom (the marginal of an iid Gaussian row, so the
    estimator stays unbiased); ``scaling="regular"`` uses the constant ``sqrt(dim)``.
    ``orthogonal=False`` returns iid ``N(0, 1)`` rows. Redrawing is the caller's choice:
    call again with a new key.

    Args:
      key: PRNG key.
      num_features: M, the number of rows.
      dim: D, the feature dimension of q and k.
      orthogonal: orthogonal blocks (True) or iid rows.
      scaling: ``"chi"`` or ``"regular"`` row norms for orthogonal blocks.

    Returns:
      ``[num_features, dim]`` float32.
    """
    name = "init_random_projection"
    m = check_positive_int(name, "num_features", num_features)
    d = check_positive_int(name, "dim", dim)
    if scaling not in ("chi", "regular"):
        raise ValueError(f"{name}: scaling must be 'chi' or 'regular' but got {scaling!r}")
    block_key, norm_key = jax.random.split(key)
    if not orthogonal:
        return jax.random.normal(block_key, (m, d), STATS_DTYPE)
    n_blocks = -(-m // d)
    gaussians = jax.random.normal(block_key, (n_blocks, d, d), STATS_DTYPE)
    rows = jnp.swapaxes(jnp.linalg.qr(gaussians)[0], 1, 2).reshape(n_blocks * d, d)[:m]
    if scaling == "regular":
        norms = jnp.full((m, 1), math.sqrt(d), STATS_DTYPE)
    else:
        norms = jnp.linalg.norm(jax.random.normal(norm_key, (m, d), STATS_DTYPE), axis=-1)[:, None]
    return rows * norms


def init_rfa_projection(key, num_features: int, dim: int, *, sigma: float = 1.0) -> jax.Array:
    """The projection for :func:`rfa_features`: orthogonal Gaussian rows divided by ``sigma``.

    Args:
      key: PRNG key.
      num_features: M.
      dim: D.
      sigma: kernel bandwidth; smaller sigma sharpens attention (``exp(q' . k' / sigma^2)``).

    Returns:
      ``[num_features, dim]`` float32.
    """
    if not sigma > 0:
        raise ValueError(f"init_rfa_projection: sigma must be positive but got {sigma}")
    return init_random_projection(key, num_features, dim) / sigma


def taylor_features(x) -> jax.Array:
    """Based's second-order Taylor map (Arora et al. 2024, "Simple linear attention language
    models balance the recall-throughput tradeoff", Eq. 4): ``phi(x) = [1, x, vec(x x^T) /
    sqrt(2)]``, so ``phi(q) . phi(k) = 1 + q.k + (q.k)^2 / 2``, the expansion of ``exp(q.k)``
    to second order, which is positive for every ``q.k`` (linear attention scales ``q`` and
    ``k`` by ``D^-1/4`` first, giving ``exp(q.k / sqrt(D))``'s expansion).

    Args:
      x: ``[L, D]`` (Based uses a small ``D``, 16: the map has ``1 + D + D^2`` features).

    Returns:
      ``[L, 1 + D + D^2]`` float32.
    """
    x = _f32(x)
    outer = (x[:, :, None] * x[:, None, :]).reshape(x.shape[0], -1) / math.sqrt(2.0)
    return jnp.concatenate([jnp.ones_like(x[:, :1]), x, outer], axis=-1)


class FeatureMap(NamedTuple):
    """How linear attention calls a named feature map."""

    fn: Callable[..., jax.Array]  # (x [L, D] f32, *arrays) -> [L, M]
    log_space: bool  # fn returns log phi; linear attention stabilises and exponentiates it
    positive: bool  # features are >= 0, so the denominator only vanishes with no keys
    arrays: tuple[int, ...]  # how many arrays (projections) the map accepts


FEATURE_MAPS = {
    "elu": FeatureMap(elu_features, False, True, (0,)),
    "relu": FeatureMap(relu_features, False, True, (0, 1)),
    "favor_positive": FeatureMap(_favor_positive_log, True, True, (1,)),
    "hyperbolic": FeatureMap(_hyperbolic_log, True, True, (1,)),
    "favor_trig": FeatureMap(favor_trig_features, False, False, (1,)),
    "rfa": FeatureMap(rfa_features, False, False, (1,)),
    "dpfp": FeatureMap(dpfp_features, False, True, (0,)),
    # Individual features may be negative, but every kernel value 1 + s + s^2 / 2 is >= 1/2,
    # so a denominator vanishes only with no keys, as for non-negative features.
    "taylor": FeatureMap(taylor_features, False, True, (0,)),
}


def resolve_feature_map(name: str, feature_map, arrays: tuple) -> FeatureMap:
    """The :class:`FeatureMap` for a registered name, or a custom callable ``phi(x, *arrays)``
    (treated as possibly negative, so its denominator is guarded)."""
    if callable(feature_map):
        return FeatureMap(feature_map, False, False, (len(arrays),))
    if feature_map not in FEATURE_MAPS:
        raise ValueError(
            f"{name}: unknown feature_map {feature_map!r}; use one of {sorted(FEATURE_MAPS)} "
            "or a callable phi(x [L, D], *arrays) -> [L, M]"
        )
    fm = FEATURE_MAPS[feature_map]
    if len(arrays) not in fm.arrays:
        raise ValueError(
            f"{name}: feature_map {feature_map!r} takes {' or '.join(map(str, fm.arrays))} "
            f"feature array(s) (e.g. a projection from init_random_projection) but got "
            f"{len(arrays)}"
        )
    return fm
