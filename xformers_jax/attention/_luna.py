"""Luna: linear unified nested attention, packing the input into a short extra sequence.

Ma et al., "Luna: Linear Unified Nested Attention" (2021); survey T2 Table 1, L 4.3.2. Pack:
the ``l`` rows of an extra sequence ``P`` attend over the input; unpack: every query attends
over the ``l`` packed rows. Both steps are exact softmax attention over a short set.

The non-causal form has a dedicated path (``_luna_full``): plain matmuls and a stable softmax
with a hand-written backward pass. Running both steps through the generic
``dot_product_attention`` and differentiating it automatically took about 1.8x as long
(fwd+bwd, L=4096, 256 rows, on CPU): the automatic backward of each softmax reduces
``dW * W`` over the whole ``[rows, keys]`` weight matrix (a slow broadcast-multiply-reduce
under XLA:CPU), where the hand-written one uses the flash-attention identity
``rowsum(dW * W) = rowsum(dO * O)`` over the ``[rows, D]`` outputs. The softmax is also
normalised on the short side (``(E V) / den``, not ``(E / den) V``), and the pack's long
matrices are laid out ``[Lk, l]`` (keys along the rows), so each matmul either reads them as
they are or transposes only a short ``[Lk, D]`` or ``[l, D]`` operand.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _contract as C
from . import _tiles
from ._dense import dot_product_attention


def init_luna_sequence(key, length: int, dim: int, *, dtype=jnp.float32):
    """The extra sequence ``P [length, dim]`` of the first Luna layer, ``N(0, 1/dim)``
    (later layers use the packed output of the previous one)."""
    length = C.check_positive_int("init_luna_sequence", "length", length)
    dim = C.check_positive_int("init_luna_sequence", "dim", dim)
    return (dim ** -0.5 * jax.random.normal(key, (length, dim))).astype(dtype)


def _luna_full_fwd_math(q, k, v, p, kv_mask, scale):
    """Non-causal Luna, the same arithmetic as the generic path to rounding: scores in
    float32, the pack in k's dtype, the packed values in v's dtype, the output in q's.
    Returns ``(out, packed_v, residuals)``."""
    f32 = C.STATS_DTYPE
    cd = k.dtype
    dk = k.shape[1]
    # Pack. Keys along the rows: s and e are [Lk, l], softmax over axis 0 (the keys).
    s = jnp.einsum("jd,ld->jl", k, p.astype(cd), preferred_element_type=f32) * scale
    if kv_mask is not None:
        s = jnp.where(kv_mask[:, None], s, -jnp.inf)
    m = _tiles.safe_max(jnp.max(s, axis=0))
    e = jnp.exp(s - m[None, :])  # exactly 0 at masked keys
    den = e.sum(0)
    den = jnp.where(den == 0, 1.0, den)  # a row that saw no key packs zeros
    kv = jnp.concatenate([k, v.astype(cd)], axis=-1)
    packed = jnp.einsum("jd,jl->dl", kv, e.astype(cd), preferred_element_type=f32).T
    packed = packed / den[:, None]  # [l, Dk + Dv], float32
    pk, pv = packed[:, :dk].astype(cd), packed[:, dk:].astype(cd).astype(v.dtype)
    # Unpack: every query over the l packed rows (none masked).
    s2 = jnp.einsum("qd,ld->ql", q, pk, preferred_element_type=f32) * scale
    m2 = _tiles.safe_max(jnp.max(s2, axis=-1))
    e2 = jnp.exp(s2 - m2[:, None])
    den2 = e2.sum(-1)
    out = jnp.einsum("ql,ld->qd", e2.astype(v.dtype), pv, preferred_element_type=f32)
    out = out / den2[:, None]
    return out.astype(q.dtype), pv, (e, den, packed, e2, den2, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _luna_full(q, k, v, p, kv_mask, scale):
    """Non-causal Luna: ``(out [Lq, Dv], packed values [l, Dv])``."""
    out, pv, _ = _luna_full_fwd_math(q, k, v, p, kv_mask, scale)
    return out, pv


def _luna_full_fwd(q, k, v, p, kv_mask, scale):
    out, pv, res = _luna_full_fwd_math(q, k, v, p, kv_mask, scale)
    return (out, pv), (q, k, v, p, res)


def _luna_full_bwd(scale, residuals, cotangents):
    """Both softmax steps' backward passes in float32, ``dS = W * (dW - rowsum(dO * O))``
    with the row sums over the outputs' short side, and A (and W) kept unnormalised: ``A^T X``
    is ``E^T (X / den)``. Masked keys have ``E = 0``, so they receive exactly zero gradient."""
    q, k, v, p, (e, den, packed, e2, den2, out) = residuals
    f32 = C.STATS_DTYPE
    g_out, g_pv = (g.astype(f32) for g in cotangents)
    q32, k32, v32, p32 = (x.astype(f32) for x in (q, k, v, p))
    dk = k.shape[1]
    pk, pv = packed[:, :dk], packed[:, dk:]
    # Unpack: out = (E2 pv) / den2, E2 = exp(scale q pk^T - max).
    d_pv = jnp.einsum("qd,ql->dl", g_out / den2[:, None], e2).T + g_pv
    dw = jnp.einsum("qd,ld->ql", g_out, pv)
    ds2 = e2 * (dw - jnp.sum(g_out * out, -1)[:, None]) * (scale / den2)[:, None]
    dq = jnp.einsum("ql,ld->qd", ds2, pk)
    d_pk = jnp.einsum("qd,ql->dl", q32, ds2).T
    # Pack: [pk | pv] = A [k | v], A^T = E / den, E = exp(scale k p^T - max).
    d_packed = jnp.concatenate([d_pk, d_pv], axis=-1)
    kv32 = jnp.concatenate([k32, v32], axis=-1)
    da = jnp.einsum("jd,ld->jl", kv32, d_packed)
    ds = e * (da - jnp.sum(d_packed * packed, -1)[None, :]) * (scale / den)[None, :]
    dkv = jnp.einsum("jl,ld->jd", e, d_packed / den[:, None])
    d_k = dkv[:, :dk] + jnp.einsum("jl,ld->jd", ds, p32)
    d_v = dkv[:, dk:]
    d_p = jnp.einsum("jd,jl->dl", k32, ds).T
    d_p = d_p.astype(p.dtype) if jnp.issubdtype(p.dtype, jnp.inexact) else None
    return dq.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_p, None


_luna_full.defvjp(_luna_full_fwd, _luna_full_bwd)


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
        m_safe = _tiles.safe_max(m)
        w = jnp.where(seen[:, :, None], jnp.exp(sc[None] - m_safe[:, None]), 0.0)
        rescale = jnp.where(jnp.isneginf(m0)[None], 0.0, jnp.exp(m0[None] - m_safe))
        den = den0[None] * rescale + w.sum(1)
        acc = acc0[None] * rescale[..., None] + jnp.einsum("tjl,jd->tld", w, kvc)
        packed = _tiles.normalise(acc, den)
        out = jax.vmap(lambda qt, pt: dot_product_attention(
            qt[None], pt[:, :dk], pt[:, dk:], scale=scale)[0])(qc, packed)
        return (m[-1], den[-1], acc[-1]), out

    init = (jnp.full((n_rows,), -jnp.inf, f32), jnp.zeros((n_rows,), f32),
            jnp.zeros((n_rows, kv.shape[-1]), f32))
    _, out = jax.lax.scan(body, init, (s, kv, qq))
    return out.reshape(-1, out.shape[-1])[:lq]


def luna_attention(q, k, v, p, *, causal: bool = False, kv_mask=None, scale: float | None = None,
                   return_packed: bool = False, chunk_size: int = 64):
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
    x = C.check_qkv(name, q, k, v)
    kv_mask = C.check_kv_mask(name, kv_mask, x.lk)
    p = jnp.asarray(p)
    if p.ndim != 2 or p.shape[1] != x.dk:
        raise ValueError(
            f"{name}: p must be [l, Dk] with Dk={x.dk} but got p{p.shape}, q{tuple(x.q.shape)}"
        )
    scale = C.resolve_scale(x.dk, scale)
    chunk = C.check_positive_int(name, "chunk_size", chunk_size)
    if not causal and isinstance(scale, (int, float, np.integer, np.floating)):
        # The dedicated path (see the module docstring); a traced scale (one that is learned
        # or passed as an array) takes the generic path below, which differentiates it too.
        out, pv = _luna_full(x.q, x.k, x.v, p, kv_mask, float(scale))
        return (out, pv) if return_packed else out
    kv = jnp.concatenate([x.k, x.v.astype(x.k.dtype)], axis=-1)
    packed = dot_product_attention(p.astype(x.k.dtype), x.k, kv, kv_mask=kv_mask, scale=scale)
    if causal:
        if x.lq != x.lk:
            raise ValueError(
                f"{name}: causal=True needs Lq == Lk but got q{tuple(x.q.shape)}, "
                f"k{tuple(x.k.shape)}"
            )
        out = _luna_causal(x.q, x.k, x.v, p, kv_mask, scale, chunk).astype(x.q.dtype)
    else:
        out = dot_product_attention(
            x.q, packed[:, : x.dk], packed[:, x.dk :].astype(x.v.dtype), scale=scale
        )
    return (out, packed[:, x.dk :].astype(x.v.dtype)) if return_packed else out
