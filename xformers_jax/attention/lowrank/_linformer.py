"""Linformer: softmax attention over keys and values projected along the length axis.

Wang et al., "Linformer: Self-Attention with Linear Complexity" (2020):
``softmax(Q (E K)^T / sqrt(d)) (F V)`` with ``E, F: [k, n]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._dense import short_softmax_attention


def init_linformer_projections(key, seq_len: int, proj_len: int, *, shared_kv: bool = False,
                               dtype=jnp.float32):
    """Draws the length projections ``E`` (and ``F``), each ``[proj_len, seq_len]``.

    Entries are ``N(0, 1/seq_len)`` so a projected key has the scale of one key. Returns
    ``(E, F)``, or ``(E,)`` when ``shared_kv`` (the paper's key-value sharing: pass only E).
    The same arrays may be passed to every head and layer (the paper's head/layer sharing).
    """
    seq_len = C.check_positive_int("init_linformer_projections", "seq_len", seq_len)
    proj_len = C.check_positive_int("init_linformer_projections", "proj_len", proj_len)
    std = seq_len ** -0.5
    ke, kf = jax.random.split(key)
    e = (std * jax.random.normal(ke, (proj_len, seq_len))).astype(dtype)
    if shared_kv:
        return (e,)
    return e, (std * jax.random.normal(kf, (proj_len, seq_len))).astype(dtype)


def linformer_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    e,
    f=None,
    *,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Linformer attention for one sequence and one head.

    Keys and values are projected along the length axis, ``K' = E K`` and ``V' = F V``
    (``[k, Dk]``, ``[k, Dv]``), and every query attends over the ``k`` projected slots with
    exact softmax attention (:func:`dot_product_attention`).

    A sequence shorter than the ``n`` the projections were built for uses their first ``Lk``
    columns, which is zero-padding it to ``n``; a longer one is rejected. Unlike the Long Range
    Arena code, padding is honoured: masked keys and values are zeroed before the projection, and
    a slot whose projection row puts no weight on any real token is masked out, so with
    ``E = F = I`` the result is exactly masked softmax attention.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      e: ``[k, n]`` key projection, ``n >= Lk``.
      f: ``[k, n]`` value projection; ``None`` shares ``e`` (key-value sharing).
      causal: unsupported; raises ``NotImplementedError``.
      kv_mask: ``bool[Lk]``, True for real keys.
      scale: score scale, ``1/sqrt(Dk)`` by default.

    Returns:
      ``[Lq, Dv]`` in q's dtype.
    """
    name = "linformer_attention"
    if causal:
        C.causal_unsupported(
            name, "the length projections E and F mix every position, future ones included, "
            "into each projected key and value"
        )
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    e = jnp.asarray(e)
    f = e if f is None else jnp.asarray(f)
    if e.ndim != 2 or f.shape != e.shape:
        raise ValueError(
            f"{name}: e and f must both be [k, n] with the same shape but got e{e.shape}, "
            f"f{f.shape}"
        )
    if x.lk > e.shape[1]:
        raise ValueError(
            f"{name}: the projections were built for sequences of at most n={e.shape[1]} "
            f"tokens but k{tuple(x.k.shape)} has Lk={x.lk}; Linformer cannot take longer inputs"
        )
    e, f = e[:, : x.lk], f[:, : x.lk]
    kk, vv = x.k, x.v
    if kv_mask is not None:
        kk = jnp.where(kv_mask[:, None], kk, 0)
        vv = jnp.where(kv_mask[:, None], vv, 0)
        real = kv_mask.astype(C.STATS_DTYPE)
    else:
        real = jnp.ones((x.lk,), C.STATS_DTYPE)
    # A slot fed only by padding (or by positions past Lk) carries no information.
    slot_mask = (jnp.abs(e.astype(C.STATS_DTYPE)) @ real > 0) | (
        jnp.abs(f.astype(C.STATS_DTYPE)) @ real > 0
    )
    pk = jnp.einsum("kn,nd->kd", e, kk, preferred_element_type=C.STATS_DTYPE)
    pv = jnp.einsum("kn,nd->kd", f, vv, preferred_element_type=C.STATS_DTYPE)
    return short_softmax_attention(x.q, pk.astype(x.k.dtype), pv.astype(x.v.dtype),
                                   kv_mask=slot_mask, scale=C.resolve_scale(x.dk, scale))
