"""Global tokens that are not a mask over one sequence: ETC's external global tokens and
Longformer's separate global projections (Ainslie et al., 2020; Beltagy et al., 2020)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._exact import block_sparse_attention
from ..patterns import KeyPadding, Longformer, Pattern
from ..patterns._sparse import _count_in, _interval_kinds


@dataclasses.dataclass(frozen=True)
class _ShiftedBand(Pattern):
    """Query i sees keys ``offset + i - radius <= j <= offset + i + radius``."""

    offset: int
    radius: int

    def mask(self, i, j, lq, lk):
        return np.abs(j - self.offset - i) <= self.radius

    def block_kinds(self, lq, lk, block_q, block_k):
        return _interval_kinds(lambda r: r + self.offset - self.radius,
                               lambda r: r + self.offset + self.radius, lq, lk, block_q, block_k)


@dataclasses.dataclass(frozen=True)
class _Rows(Pattern):
    """Only the query rows in ``rows`` see keys, all of them."""

    rows: tuple[int, ...]

    def mask(self, i, j, lq, lk):
        return np.broadcast_to(np.isin(i, self.rows), np.broadcast_shapes(np.shape(i), np.shape(j)))

    def block_kinds(self, lq, lk, block_q, block_k):
        r0, r1, c0, _ = Pattern.tile_bounds(lq, lk, block_q, block_k)
        n = np.broadcast_to(_count_in(np.asarray(self.rows, np.int64), r0, r1), (r0.shape[0], c0.shape[1]))
        return Pattern.tile_kinds(n == r1 - r0 + 1, n == 0)


def _ones_or(mask, n):
    return jnp.ones((n,), bool) if mask is None else mask


def etc_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    q_global,
    k_global,
    v_global,
    *,
    radius: int,
    k_local_to_global=None,
    k_global_to_local=None,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    global_kv_mask=None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    key=None,
):
    """ETC global-local attention with ``G`` external global tokens (Ainslie et al., 2020).

    Four pieces, two softmaxes: a global token attends to every global token (g2g) and every
    local token (g2l); a local token ``i`` attends to every global token (l2g) and to local
    tokens ``|i - j| <= radius`` (l2l). ETC gives the pieces their own projections: pass the
    keys of the global tokens as seen by local queries (``k_local_to_global``, default
    ``k_global``) and of the local tokens as seen by global queries (``k_global_to_local``,
    default ``k``). The local side runs block-sparse, so the cost is
    ``O(L * (G + radius) + G * L)``.

    Args:
      q, k: ``[L, Dk]``, v: ``[L, Dv]``: the local (long) tokens' projections.
      q_global, k_global: ``[G, Dk]``, v_global: ``[G, Dv]``: the global tokens' projections.
      radius: l2l window radius.
      kv_mask: ``bool[L]``; global_kv_mask: ``bool[G]``.
      causal: unsupported (global tokens summarise the whole input).

    Returns:
      ``(out [L, Dv], out_global [G, Dv])``.
    """
    name = "etc_attention"
    if causal:
        C.causal_unsupported(name, "ETC's global tokens summarise the whole input (Ainslie et al., 2020)")
    x = C.check_qkv(name, q, k, v)
    g = C.check_qkv(name, q_global, k_global, v_global)
    if x.lq != x.lk or x.dk != g.dk or x.dv != g.dv:
        raise ValueError(
            f"{name}: need lq == lk and matching dims between local q{q.shape}, k{k.shape}, "
            f"v{v.shape} and global q{q_global.shape}, k{k_global.shape}, v{v_global.shape}"
        )
    if isinstance(radius, bool) or not isinstance(radius, (int, np.integer)) or radius < 0:
        raise ValueError(f"{name}: radius must be a non-negative integer but got {radius!r}")
    k_l2g = g.k if k_local_to_global is None else jnp.asarray(k_local_to_global)
    k_g2l = x.k if k_global_to_local is None else jnp.asarray(k_global_to_local)
    if k_l2g.shape != g.k.shape or k_g2l.shape != x.k.shape:
        raise ValueError(
            f"{name}: k_local_to_global must be {g.k.shape} and k_global_to_local {x.k.shape}; "
            f"got {k_l2g.shape}, {k_g2l.shape}"
        )
    kv_mask = C.check_kv_mask(name, kv_mask, x.lk)
    global_kv_mask = C.check_kv_mask(name, global_kv_mask, g.lk)
    values = jnp.concatenate([g.v, x.v])
    mask = None
    if kv_mask is not None or global_kv_mask is not None:
        mask = jnp.concatenate([_ones_or(global_kv_mask, g.lk), _ones_or(kv_mask, x.lk)])
    local = block_sparse_attention(
        x.q, jnp.concatenate([k_l2g, x.k]), values,
        KeyPadding(g.lk) | _ShiftedBand(g.lk, radius), kv_mask=mask, scale=scale,
        block_q=block_q, block_k=block_k,
    )
    glob = block_sparse_attention(
        g.q, jnp.concatenate([g.k, k_g2l]), values, KeyPadding(g.lk + x.lk), kv_mask=mask,
        scale=scale, block_q=block_q, block_k=block_k,
    )
    return local, glob


def longformer_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    q_global,
    k_global,
    v_global,
    *,
    window: int,
    dilation: int = 1,
    global_tokens: tuple[int, ...],
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Longformer attention with separate global projections (Beltagy et al., 2020).

    Every query attends, with the ordinary projections, to its dilated window
    (``window`` keys per side, gaps ``dilation``) and to the global tokens; the rows of the
    global tokens are recomputed with the global projections ``Q_g, K_g, V_g`` over every key.
    Both parts are block-sparse, ``O(L * window + G * L)``.

    Args:
      q, k, q_global, k_global: ``[L, Dk]``; v, v_global: ``[L, Dv]``.
      global_tokens: positions with global attention (e.g. ``(0,)`` for [CLS]).
      causal: decoding order (every row sees only keys ``j <= i``).
      kv_mask: ``bool[L]``.

    Returns:
      ``[L, Dv]``.
    """
    name = "longformer_attention"
    x = C.check_qkv(name, q, k, v)
    g = C.check_qkv(name, q_global, k_global, v_global)
    if not (x.lq == x.lk == g.lq == g.lk) or (x.dk, x.dv) != (g.dk, g.dv):
        raise ValueError(
            f"{name}: local q{q.shape}, k{k.shape}, v{v.shape} and global q{q_global.shape}, "
            f"k{k_global.shape}, v{v_global.shape} must share one length and the dims"
        )
    tokens = tuple(sorted({int(t) for t in global_tokens}))
    if not tokens or tokens[0] < 0 or tokens[-1] >= x.lq:
        raise ValueError(f"{name}: global_tokens {global_tokens!r} must be positions in [0, {x.lq})")
    common = dict(causal=causal, kv_mask=kv_mask, scale=scale, block_q=block_q, block_k=block_k)
    out = block_sparse_attention(x.q, x.k, x.v, Longformer(window, dilation, tokens), **common)
    glob = block_sparse_attention(g.q, g.k, g.v, _Rows(tokens), **common)
    is_global = jnp.zeros((x.lq,), bool).at[jnp.asarray(tokens)].set(True)
    return jnp.where(is_global[:, None], glob, out)
