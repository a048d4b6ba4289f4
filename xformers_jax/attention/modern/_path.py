"""PaTH attention: position encoding by accumulated Householder transformations (Yang et al.,
2025, "PaTH Attention: Position Encoding via Accumulating Householder Transformations").

Causal softmax attention whose score between query ``i`` and key ``j <= i`` passes through the
data-dependent transforms of every position after ``j`` up to ``i``::

    s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j          (the empty product, j = i, is I)
    H_t = I - beta_t w_t w_t^T

with ``w_t`` unit-norm and ``beta_t`` in ``(0, 2)``, both functions of the tokens. The layer
(the ``path`` kind) computes them as the paper does: ``w_t`` from ``x_t`` through a rank-r
projection, a short causal convolution over the last few tokens (width 3, SiLU after it) and
an L2 normalisation, ``beta_t = 2 sigmoid(w_beta^T x_t + b)``, one transform per key/value
head. A key is transformed by each later token in turn (``k_j <- H_t k_j`` at
step ``t``), which is how the paper decodes. ``beta = 0`` makes every ``H_t = I``: plain causal
softmax attention. A padded token (``kv_mask`` False) is absent: no key, and its ``H`` is
``I``. Packed rows (``segment_ids``, each document one contiguous run of positions): a query
sees the keys of its own document only, so every transform between them is its document's.

Fast form (:func:`path_attention`, the paper's blockwise algorithm). Within a block of ``c``
positions the product of Householders has the compact WY/UT form (Joffrain et al., 2006;
the same transform DeltaNet's chunks use, :func:`~..linear._delta.unit_lower_inverse`): with
``T = (I + strictly_lower(diag(beta) W W^T))^{-1}``,

- ``H_{c-1} ... H_0 = I - W^T Y`` with ``Y = T diag(beta) W``;
- ``q~_i^T = q_i^T H_i ... H_0 = q_i^T - tril(Q W^T)_i Y`` (the query carried to the block
  start);
- ``k~_j = H_{c-1} ... H_{j+1} k_j = k_j - U_{:, j}^T W`` with ``U = T strictly_lower(diag(beta)
  W K^T)`` (the key carried to the block end);
- the block's own scores ``q_i^T H_i ... H_{j+1} k_j = (Q K^T - tril(Q W^T) U)_ij``, ``j <= i``.

A query block then walks back over the earlier key blocks: it scores block ``b`` with its
current transformed queries against ``k~`` of ``b``, then carries the queries through ``b``'s
product (``Q <- Q - (Q W_b^T) Y_b``, ``O(c^2 D)``), the scores merged by the online softmax of
the tiled kernels (``kernels.online_step``). Each (query block, key block) pair sees its own
transformed queries, so the shared tiled kernel (one ``q`` for every key tile) cannot run it.
Time ``O(L^2 D + L c^2)``; memory ``O(g L (D + c))`` for ``g = group`` query blocks run at a
time under ``jax.checkpoint`` (the backward pass recomputes and holds one group's walk at a
time: 427 MB of XLA temporaries for fwd+bwd at L = 4096, 4 heads of 64, ``c = 64``, ``g = 8``,
against causal flash's 41 MB); no ``L x L`` map and no ``L x L x D`` array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from ...kernels import STATS_DTYPE, cdiv, finish, online_step, pad_to
from .. import _contract as C
from ..linear._delta import unit_lower_inverse


def _check_transforms(name, w, beta, x):
    w, beta = jnp.asarray(w), jnp.asarray(beta)
    if w.shape != (x.lk, x.dk) or beta.shape != (x.lk,):
        raise ValueError(f"{name}: needs w [Lk, Dk] = [{x.lk}, {x.dk}] and beta [Lk] = "
                         f"[{x.lk}] (one Householder transform per key position); got "
                         f"w{tuple(w.shape)}, beta{tuple(beta.shape)}")
    return w, beta


def _prologue(name, q, k, v, w, beta, causal, kv_mask, segment_ids):
    if not causal:
        raise ValueError(f"{name}: PaTH's transforms accumulate from each key to a later query, "
                         "so it exists only with causal=True")
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    C.check_same_length(name, x, "causal PaTH is self-attention (query i at position i), "
                                 "needs Lq == Lk")
    w, beta = _check_transforms(name, w, beta, x)
    segments = C.check_segment_ids(name, segment_ids, x.lq, x.lk)
    f32 = STATS_DTYPE
    w, beta = w.astype(f32), beta.astype(f32)
    if kv_mask is not None:  # a padded token is absent: its transform is the identity
        w = jnp.where(kv_mask[:, None], w, 0.0)
        beta = jnp.where(kv_mask, beta, 0.0)
    return x, kv_mask, w, beta, segments


def path_attention_reference(q, k, v, w, beta, *, causal: bool = True, kv_mask=None,
                             segment_ids=None, scale: float | None = None):
    """PaTH attention from its definition (float32): for every query ``i`` the keys
    ``H_i ... H_{j+1} k_j`` materialised (``[L, L, D]``), one dense causal softmax. For tests
    and small sizes: ``O(L^2 D^2)`` time. Arguments as :func:`path_attention`."""
    name = "path_attention_reference"
    x, kv_mask, w, beta, segments = _prologue(name, q, k, v, w, beta, causal, kv_mask,
                                              segment_ids)
    f32 = STATS_DTYPE
    scale = C.resolve_scale(x.dk, scale)
    eye = jnp.eye(x.dk, dtype=f32)
    hs = eye - beta[:, None, None] * w[:, :, None] * w[:, None, :]  # [L, D, D]
    kf = x.k.astype(f32)
    pos = jnp.arange(x.lk)

    def keys_for(i):
        # Walk j from the last position down: P = H_i ... H_{j+1} scores key j, then takes H_j.
        def step(p, j):
            key_j = p @ kf[j]
            return jnp.where(j <= i, p @ hs[j], p), key_j

        _, keys = lax.scan(step, eye, pos, reverse=True)
        return keys  # [L, D]: H_i ... H_{j+1} k_j (k_j itself for j >= i)

    keys = jax.vmap(keys_for)(pos)  # [L, L, D]
    s = jnp.einsum("id,ijd->ij", x.q.astype(f32), keys) * scale
    keep = pos[None, :] <= pos[:, None]
    if kv_mask is not None:
        keep = keep & kv_mask[None, :]
    if segments is not None:
        keep = keep & (segments[0][:, None] == segments[1][None, :])
    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    p = jnp.where(keep, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    out = p @ x.v.astype(f32) / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return out.astype(q.dtype)


def _block_factors(q, k, w, beta):
    """The UT form of every block (``[n, c, ...]`` arrays, float32): ``(q~, k~, Y, S)`` with
    ``q~`` the queries carried to their block's start, ``k~`` the keys carried to their
    block's end, ``Y`` (the block's product is ``I - W^T Y``) and the block's own unscaled
    scores ``S [n, c, c]`` (valid for ``j <= i``)."""
    c = q.shape[1]
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    incl = jnp.tril(jnp.ones((c, c), bool))
    bw = beta[..., None] * w
    t = unit_lower_inverse(jnp.where(strict, jnp.einsum("ncd,ned->nce", bw, w), 0.0))
    y = t @ bw
    u = t @ jnp.where(strict, jnp.einsum("nrd,njd->nrj", bw, k), 0.0)
    k_end = k - jnp.einsum("nrj,nrd->njd", u, w)
    qw = jnp.where(incl, jnp.einsum("nid,nrd->nir", q, w), 0.0)
    q_start = q - qw @ y
    own = jnp.einsum("nid,njd->nij", q, k) - qw @ u
    return q_start, k_end, y, own


def path_attention(
    q: Float[Array, "seq qk_dim"],
    k: Float[Array, "seq qk_dim"],
    v: Float[Array, "seq v_dim"],
    w: Float[Array, "seq qk_dim"],
    beta: Float[Array, "seq"],
    *,
    causal: bool = True,
    kv_mask: Bool[Array, "seq"] | None = None,
    segment_ids: Int[Array, "seq"] | None = None,
    scale: float | None = None,
    key=None,
    block_size: int = 64,
    group: int = 8,
) -> Float[Array, "seq v_dim"]:
    """PaTH attention for one head (Yang et al., 2025), by the paper's blockwise algorithm.

    Args:
      q: ``[L, Dk]``. k: ``[L, Dk]``. v: ``[L, Dv]``.
      w: ``[L, Dk]`` the Householder directions (the paper's are unit-norm).
      beta: ``[L]`` the strengths (the paper's lie in ``(0, 2)``: ``2 sigmoid(.)``; 0 is the
        identity, 2 a reflection).
      causal: must be True (the transforms accumulate from a key to a later query).
      kv_mask: ``bool[L]``, True for real tokens; a padded token has no key and the identity
        transform. segment_ids: ``int[L]`` (or a ``(q_ids, kv_ids)`` pair) for packed rows,
        each document one contiguous run of positions: query ``i`` sees key ``j`` only when
        their ids are equal. scale: ``1/sqrt(Dk)`` by default. key: unused (the contract's).
      block_size: positions per block ``c`` (the UT form of ``c`` Householders). The UT
        inverse's entries grow when many directions in a block are nearly equal with strengths
        near 2 (reflections that cancel in pairs): identical directions with ``beta = 2``
        exactly at ``L = 512`` differ from the reference by 1e-3 with ``c = 64`` and 4e-5
        with ``c = 16``; random directions by 2e-6 for either.
      group: query blocks run together per step (the backward pass recomputes one group's
        walk at a time, ``O(group L (D + c))`` memory).

    Returns:
      ``[L, Dv]`` in q's dtype, equal to :func:`path_attention_reference`. Time ``O(L^2 D +
      L c^2)``, memory ``O(group L (D + c))``.
    """
    name = "path_attention"
    C.check_positive_int(name, "block_size", block_size)
    C.check_positive_int(name, "group", group)
    x, kv_mask, w, beta, segments = _prologue(name, q, k, v, w, beta, causal, kv_mask,
                                              segment_ids)
    f32 = STATS_DTYPE
    scale = C.resolve_scale(x.dk, scale)
    length = x.lq
    c = min(block_size, length)
    n = cdiv(length, c)
    g = min(group, n)
    ng = cdiv(n, g)
    real = jnp.ones((length,), bool) if kv_mask is None else kv_mask

    def blocks(a, value=0):
        return pad_to(a, ng * g * c, value=value).reshape(ng * g, c, *a.shape[1:])

    qb, kb, vb, wb = (blocks(a.astype(f32)) for a in (x.q, x.k, x.v, w))
    betab, realb = blocks(beta), blocks(real, value=False)
    if segments is None:
        seg_q = seg_k = jnp.zeros((ng * g, c), jnp.int32)
    else:
        seg_q, seg_k = blocks(segments[0]), blocks(segments[1])
    q_start, k_end, y, own = _block_factors(qb, kb, wb, betab)
    keep = jnp.tril(jnp.ones((c, c), bool)) & realb[:, None, :]
    keep = keep & (seg_q[:, :, None] == seg_k[:, None, :])
    own = jnp.where(keep, own * scale, -jnp.inf)

    @jax.checkpoint
    def one_group(first):
        """Query blocks ``first .. first + g - 1``: ``(out [g, c, Dv], lse [g, c, 1])``."""
        ids = first + jnp.arange(g)

        def start(i):  # the block's own keys
            zeros = jnp.zeros((c, 1), f32)
            return online_step(own[i], zeros - jnp.inf, zeros, jnp.zeros((c, vb.shape[-1]), f32),
                               lambda p: p @ vb[i])

        m, l, acc = jax.vmap(start)(ids)

        def step(carry, back):
            def walk(carry):
                def one(i, qc, m, l, acc):
                    b = jnp.maximum(i - back, 0)
                    keep = realb[b][None, :] & (seg_q[i][:, None] == seg_k[b][None, :])
                    s = jnp.where(keep & (i >= back), qc @ k_end[b].T * scale, -jnp.inf)
                    m, l, acc = online_step(s, m, l, acc, lambda p: p @ vb[b])
                    return qc - (qc @ wb[b].T) @ y[b], m, l, acc

                return jax.vmap(one)(ids, *carry)

            # Key block first + g - 1 - back is the last any query block of the group needs.
            return lax.cond(back <= first + g - 1, walk, lambda c_: c_, carry), None

        carry = (q_start[ids], m, l, acc)
        if n > 1:
            carry, _ = lax.scan(step, carry, jnp.arange(1, n))
        _, m, l, acc = carry
        return jax.vmap(finish)(m, l, acc)

    out, _ = lax.map(one_group, jnp.arange(ng) * g)
    return out.reshape(ng * g * c, -1)[:length].astype(q.dtype)


def path_update_keys(k: Float[Array, "cache qk_dim"], w_t: Float[Array, "qk_dim"], beta_t
                     ) -> Float[Array, "cache qk_dim"]:
    """One decoding step's transform of a PaTH key cache, the paper's inference form: every
    cached key ``k_j <- H_t k_j = k_j - beta_t (w_t . k_j) w_t`` before token ``t``'s own key
    is appended (its query then attends the cache by plain softmax). ``O(C D)`` per step for
    ``C`` cached keys; computed in float32, returned in ``k``'s dtype."""
    kf = k.astype(STATS_DTYPE)
    wf = jnp.asarray(w_t, STATS_DTYPE)
    return (kf - jnp.asarray(beta_t, STATS_DTYPE) * (kf @ wf)[:, None] * wf).astype(k.dtype)
