"""Synthesizer: attention weights synthesised without (or mixed with) query-key dot products.

Tay et al., "Synthesizer: Rethinking Self-Attention in Transformer Models" (2020). Every form
gives logits ``[Lq, Lk]`` that are softmaxed and applied to the values; mixtures add the
logits of several forms with weights. Equation numbers below are those of Fournier et al.
(2021, "A Practical Survey on Faster and Lighter Transformers", Eq. 23-27).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._dense import attend_logits, combined_pattern, dot_product_attention

KINDS = ("dot", "dense", "random", "fixed_random", "factorized_dense", "factorized_random")


def init_synthesizer(key, kind: str, dim: int, max_len: int, *, rank: int = 8,
                     dtype=jnp.float32):
    """Parameters of one synthesizer form, for inputs ``[L, dim]`` with ``L <= max_len``.

    - ``"dense"``: ``(W1 [dim, dim], b1 [dim], W2 [dim, max_len], b2 [max_len])`` (Eq 23);
    - ``"random"``/``"fixed_random"``: ``R [max_len, max_len]`` (fixed: never trained);
    - ``"factorized_dense"``: ``(WA [dim, a], WB [dim, b])`` with ``a * b == max_len``,
      ``a`` the largest divisor of max_len not above its square root (Eq 25-26);
    - ``"factorized_random"``: ``(R1 [max_len, rank], R2 [max_len, rank])`` (Eq 27);
    - ``"dot"``: ``None`` (plain scaled dot-product logits).
    """
    name = "init_synthesizer"
    if kind not in KINDS:
        raise ValueError(f"{name}: kind must be one of {KINDS}, got {kind!r}")
    dim = C.check_positive_int(name, "dim", dim)
    n = C.check_positive_int(name, "max_len", max_len)
    k1, k2 = jax.random.split(key)
    normal = lambda k, shape, fan_in: (fan_in ** -0.5 * jax.random.normal(k, shape)).astype(dtype)
    if kind == "dot":
        return None
    if kind == "dense":
        return (normal(k1, (dim, dim), dim), jnp.zeros((dim,), dtype),
                normal(k2, (dim, n), dim), jnp.zeros((n,), dtype))
    if kind in ("random", "fixed_random"):
        return normal(k1, (n, n), 1)
    if kind == "factorized_dense":
        a = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
        return normal(k1, (dim, a), dim), normal(k2, (dim, n // a), dim)
    rank = C.check_positive_int(name, "rank", rank)
    return normal(k1, (n, rank), rank ** 0.5), normal(k2, (n, rank), rank ** 0.5)


def _logits(name, kind, params, x, lk):
    """Synthetic logits ``[Lq, Lk]`` of one form from the inputs ``x [Lq, D]``."""
    lq = x.shape[0]
    f32 = C.STATS_DTYPE
    if kind == "dense":
        w1, b1, w2, b2 = params
        n = w2.shape[1]
        hidden = jax.nn.relu(jnp.dot(x, w1, preferred_element_type=f32) + b1)
        logits = jnp.dot(hidden, w2.astype(f32)) + b2
    elif kind in ("random", "fixed_random"):
        r = jnp.asarray(params)
        r = jax.lax.stop_gradient(r) if kind == "fixed_random" else r
        n = r.shape[1]
        if r.shape[0] < lq:
            raise ValueError(
                f"{name}: {kind} R{r.shape} was built for at most {r.shape[0]} queries but Lq={lq}"
            )
        logits = r[:lq].astype(f32)
    elif kind == "factorized_dense":
        wa, wb = params
        a, b = wa.shape[1], wb.shape[1]
        n = a * b
        # Tile A b times and repeat each entry of B a times, so column j pairs A[j % a]
        # with B[j // a]: the elementwise product is a rank-structured [Lq, a*b] logit row.
        ta = jnp.tile(jnp.dot(x, wa, preferred_element_type=f32), (1, b))
        tb = jnp.repeat(jnp.dot(x, wb, preferred_element_type=f32), a, axis=1)
        logits = ta * tb
    elif kind == "factorized_random":
        r1, r2 = params
        n = r2.shape[0]
        if r1.shape[0] < lq:
            raise ValueError(
                f"{name}: factorized_random R1{r1.shape} was built for at most {r1.shape[0]} "
                f"queries but Lq={lq}"
            )
        logits = jnp.dot(r1[:lq], r2[:lk].T, preferred_element_type=f32)
    else:
        raise ValueError(f"{name}: unknown synthesizer form {kind!r}; the forms are {KINDS}")
    if lk > n:
        raise ValueError(
            f"{name}: the {kind} synthesizer was built for at most {n} keys but Lk={lk}"
        )
    return logits[:, :lk]


def synthesizer_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    params: dict,
    weights: dict | None = None,
    *,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Synthesizer attention (one form or a mixture) for one sequence and one head.

    ``softmax(sum_f w_f S_f) V`` over the forms ``f`` in ``params``, where ``S_dot = q k^T *
    scale`` and the others are synthetic (see :func:`init_synthesizer`); dense forms read the
    queries ``q`` as their token inputs. The softmax, masking and causality are
    :func:`dot_product_attention`'s, with the synthetic logits as its bias. Causal decoding is
    allowed: every form's logit for (i, j) depends on token i and position j only.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      params: ``{form: parameters}``, forms from ``KINDS`` (``"dot"`` takes ``None``).
      weights: ``{form: scalar}`` mixture weights (may be traced, i.e. learned); all 1 if None.
      causal: query i sees keys ``j <= i`` only.
      kv_mask: ``bool[Lk]``, True for real keys.
      scale: scale of the dot-product form, ``1/sqrt(Dk)`` by default.

    Returns:
      ``[Lq, Dv]`` in q's dtype.
    """
    name = "synthesizer_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    if not params:
        raise ValueError(f"{name}: params must name at least one form of {KINDS}")
    weights = {} if weights is None else dict(weights)
    unknown = set(weights) - set(params)
    if unknown:
        raise ValueError(f"{name}: weights name forms {sorted(unknown)} missing from params")
    bias = jnp.zeros((x.lq, x.lk), C.STATS_DTYPE)
    for kind, p in params.items():
        if kind != "dot":
            bias = bias + weights.get(kind, 1.0) * _logits(name, kind, p, x.q, x.lk)
    if "dot" not in params:
        # No dot-product form: the synthetic logits are the scores, and no q k^T is computed
        # (the saving the Synthesizer paper measures).
        return attend_logits(bias, x.v, kv_mask=kv_mask,
                             pattern=combined_pattern(name, None, causal), out_dtype=x.q.dtype)
    dot_q = x.q * jnp.asarray(weights.get("dot", 1.0), x.q.dtype)
    return dot_product_attention(dot_q, x.k, x.v, bias=bias, causal=causal, kv_mask=kv_mask,
                                 scale=scale)
