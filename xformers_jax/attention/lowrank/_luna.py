"""Luna: linear unified nested attention, packing the input into a short extra sequence.

Ma et al., "Luna: Linear Unified Nested Attention" (2021). Pack: the ``l`` rows of an
extra sequence ``P`` attend over the input; unpack: every query attends over the ``l`` packed
rows. Both steps are exact softmax attention over a short set.

Both softmax steps (and the causal form's whole-sequence pack) run through
:func:`~xformers_jax.attention._dense.short_softmax_attention`, softmax attention whose
hand-written backward takes the softmax row sums from ``dO * O`` on the short ``[rows, D]``
side; differentiating ``dot_product_attention`` automatically reduces ``dW * W`` over the
``[rows, keys]`` weights instead, which made the non-causal form about 1.8x slower (fwd+bwd,
L=4096, 256 rows, on CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from ... import kernels
from .._dense import dot_product_attention, short_softmax_attention


def init_luna_sequence(key, length: int, dim: int, *, dtype=jnp.float32):
    """The extra sequence ``P [length, dim]`` of the first Luna layer, ``N(0, 1/dim)``
    (later layers use the packed output of the previous one)."""
    length = C.check_positive_int("init_luna_sequence", "length", length)
    dim = C.check_positive_int("init_luna_sequence", "dim", dim)
    return (dim ** -0.5 * jax.random.normal(key, (length, dim))).astype(dtype)


def _luna_causal(q, k, v, p, kv_mask, scale, chunk):
    """Query t unpacks from ``softmax_{j<=t}(p k_j) [k_j, v_j]``, the pack over its prefix.

    One chunk of positions per scan step (rematerialised in the backward pass, so memory is
    one chunk's). The running max per extra row is cumulative per position, so no future
    score enters a past position, not even as a stabiliser.
    """
    f32 = C.STATS_DTYPE
    lq, dk = q.shape
    n_rows = p.shape[0]
    kv = jnp.concatenate([k, v], axis=-1).astype(f32)
    s = jnp.einsum("ld,jd->jl", p, k, preferred_element_type=f32) * scale
    if kv_mask is not None:
        s = jnp.where(kv_mask[:, None], s, -jnp.inf)
    pad = -lq % chunk
    s = jnp.pad(s, ((0, pad), (0, 0)), constant_values=-jnp.inf)
    kv = jnp.pad(kv, ((0, pad), (0, 0)))
    qq = jnp.pad(q, ((0, pad), (0, 0)))
    n = (lq + pad) // chunk
    s, kv, qq = (a.reshape(n, chunk, *a.shape[1:]) for a in (s, kv, qq))
    seen = jnp.tril(jnp.ones((chunk, chunk), bool))

    @jax.checkpoint
    def body(carry, xs):
        m0, den0, acc0 = carry
        sc, kvc, qc = xs
        m = jax.lax.stop_gradient(jnp.maximum(m0[None], jax.lax.cummax(sc, axis=0)))
        m_safe = kernels.safe_max(m)
        w = jnp.where(seen[:, :, None], jnp.exp(sc[None] - m_safe[:, None]), 0.0)
        rescale = jnp.where(jnp.isneginf(m0)[None], 0.0, jnp.exp(m0[None] - m_safe))
        den = den0[None] * rescale + w.sum(1)
        acc = acc0[None] * rescale[..., None] + jnp.einsum("tjl,jd->tld", w, kvc)
        packed = kernels.normalise(acc, den)
        out = jax.vmap(lambda qt, pt: dot_product_attention(
            qt[None], pt[:, :dk], pt[:, dk:], scale=scale)[0])(qc, packed)
        return (m[-1], den[-1], acc[-1]), out

    init = (jnp.full((n_rows,), -jnp.inf, f32), jnp.zeros((n_rows,), f32),
            jnp.zeros((n_rows, kv.shape[-1]), f32))
    _, out = jax.lax.scan(body, init, (s, kv, qq))
    return out.reshape(-1, out.shape[-1])[:lq]


def luna_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    p,
    *,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    return_packed: bool = False,
    chunk_size: int = 64,
    key=None,
):
    """Luna attention for one sequence and one head.

    Pack: ``A = softmax(P K^T * scale)`` (``[l, Lk]``, masked keys excluded); the packed keys
    and values are ``A K`` and ``A V``. Unpack: ``softmax(Q (A K)^T * scale) (A V)``. The
    caller (a module) supplies ``P`` already projected to ``Dk``, and feeds the packed values
    (``return_packed``) to the next layer as its extra sequence.

    Causal form: query ``t`` unpacks from a pack over its prefix ``j <= t`` only, computed
    chunk by chunk with a per-position running max, so no future key reaches it.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      p: ``[l, Dk]`` the extra (packing) sequence.
      causal: pack over each query's prefix (needs ``Lq == Lk``).
      kv_mask: ``bool[Lk]``, True for real keys.
      scale: score scale, ``1/sqrt(Dk)`` by default (both steps).
      return_packed: also return the packed values ``[l, Dv]`` (over the whole sequence).
      chunk_size: positions per step of the causal form (memory ``chunk^2 l + chunk l D``).

    Returns:
      ``[Lq, Dv]`` in q's dtype, or ``(out, packed [l, Dv])``.
    """
    name = "luna_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    p = jnp.asarray(p)
    if p.ndim != 2 or p.shape[1] != x.dk:
        raise ValueError(
            f"{name}: p must be [l, Dk] with Dk={x.dk} but got p{p.shape}, q{tuple(x.q.shape)}"
        )
    scale = C.resolve_scale(x.dk, scale)
    chunk = C.check_positive_int(name, "chunk_size", chunk_size)
    kv = jnp.concatenate([x.k, x.v.astype(x.k.dtype)], axis=-1)
    packed = short_softmax_attention(p.astype(x.k.dtype), x.k, kv, kv_mask=kv_mask, scale=scale)
    if causal:
        C.check_same_length(name, x, "causal=True needs Lq == Lk")
        out = _luna_causal(x.q, x.k, x.v, p, kv_mask, scale, chunk).astype(x.q.dtype)
    else:
        out = short_softmax_attention(
            x.q, packed[:, : x.dk], packed[:, x.dk :].astype(x.v.dtype), scale=scale
        )
    return (out, packed[:, x.dk :].astype(x.v.dtype)) if return_packed else out
