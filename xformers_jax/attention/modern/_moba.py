"""MoBA: mixture of block attention (Lu et al., 2025, "MoBA: Mixture of Block Attention for
Long-Context LLMs", Section 2.2, Eqs. 3-6).

The keys are cut into blocks of ``block_size``. Query ``q_i`` scores block ``j`` by its
mean-pooled key, ``s_ij = <q_i, mean(K_j)>`` (Eq. 6), and attends, with one softmax, over the
keys of the ``top_k`` blocks it scores highest (Eq. 5's gate). Causal: a block that starts
after the query is never chosen, and the query's own block is always one of the ``top_k``
(attended with the causal mask inside it), so ``top_k - 1`` are chosen among the past blocks.
Padded keys take no part in a pooled key, and a block of padding alone is never chosen.

Fast form (:func:`moba_attention`): the query's own block runs on the tiled kernel
(``flash_attention`` with ``BlockLocal(block_size) & Causal``); the chosen past blocks run
key block by key block (:func:`selected_blocks_attention`: the (query, block) pairs sorted by
block, each block's queries in tiles, one ``[tile, D] x [D, block_size]`` matmul per tile,
never an ``L x L`` map); the two parts merge by their log-sum-exps (``kernels.merge_by_lse``).
Time ``O(L top_k block_size D)`` plus the gate's ``O(L (L / block_size) D)``; memory
``O(L top_k D)`` for the per-pair partial outputs. The backward pass recomputes the tiles from
each query's log-sum-exp (the tiled kernel's custom VJP), so it stores no probabilities.

Speed on a CPU: the selected part does ``top_k / (L / 2)`` of causal attention's scores, but
in tiles of ``block_size`` keys; XLA:CPU computes a 128-key tile at about twice the cost per
score of the 512 x 512 tiles causal flash attention uses, which caps the speed-up of 1/8 of the
keys in blocks of 128 near 2x rather than 4x (the ``modern_attention`` suite's (why) rows
measure it); blocks of 512 come closer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ...kernels import STATS_DTYPE, cdiv, lse_vjp, merge_by_lse, pad_to, safe_max
from .. import _contract as C
from .._exact import flash_attention
from ..patterns import BlockLocal


def pooled_blocks(k, kv_mask, block_size: int):
    """Mean-pooled keys of the blocks of ``k [Lk, D]`` over the real keys (``kv_mask``):
    ``(pooled f32[nb, D], real bool[nb])``; a block with no real key pools to 0 and is not
    real."""
    lk = k.shape[0]
    nb = cdiv(lk, block_size)
    w = (jnp.ones((lk,), bool) if kv_mask is None else kv_mask).astype(STATS_DTYPE)
    w = pad_to(w, nb * block_size)
    kk = pad_to(k.astype(STATS_DTYPE), nb * block_size).reshape(nb, block_size, -1)
    w = w.reshape(nb, block_size)
    count = w.sum(-1)
    pooled = (kk * w[..., None]).sum(1) / jnp.maximum(count, 1.0)[:, None]
    return pooled, count > 0


def select_blocks(gates, real, q_pos, block_size: int, top_k: int, causal: bool):
    """The blocks each query chooses by its ``gates f32[Lq, nb]`` among the ``real`` ones:
    ``(index int32[Lq, n], chosen bool[Lq, n])``; causal: ``n = top_k - 1`` among the blocks
    wholly before the query's own block (at ``q_pos [Lq]``), which is kept apart; else
    ``n = top_k`` among all. A slot is not ``chosen`` when fewer blocks qualify."""
    nb = gates.shape[1]
    ok = jnp.broadcast_to(real, gates.shape)
    if causal:
        ok = ok & (jnp.arange(nb)[None, :] < (q_pos // block_size)[:, None])
    n = min(top_k - 1 if causal else top_k, nb)
    if n == 0:
        return (jnp.zeros((gates.shape[0], 0), jnp.int32),
                jnp.zeros((gates.shape[0], 0), bool))
    val, idx = jax.lax.top_k(jnp.where(ok, gates, -jnp.inf), n)
    return idx.astype(jnp.int32), jnp.isfinite(val)


def _check(name, block_size, top_k):
    C.check_positive_int(name, "block_size", block_size)
    C.check_positive_int(name, "top_k", top_k)


def moba_reference(q, k, v, *, block_size: int, top_k: int, causal: bool = False,
                   kv_mask=None, scale=None, q_offset=0):
    """MoBA with the chosen blocks as a dense ``[Lq, Lk]`` mask and one dense softmax
    (float32): the paper's definition, for tests and for one decoding step (queries at
    positions ``q_offset + arange(Lq)``, ``q_offset`` may be traced)."""
    name = "moba_reference"
    _check(name, block_size, top_k)
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    scale = C.resolve_scale(x.dk, scale)
    q_pos = q_offset + jnp.arange(x.lq)
    k_pos = jnp.arange(x.lk)
    pooled, real = pooled_blocks(x.k, kv_mask, block_size)
    qf = x.q.astype(STATS_DTYPE)
    idx, chosen = select_blocks(qf @ pooled.T, real, q_pos, block_size, top_k, causal)
    nb = pooled.shape[0]
    sel = jnp.zeros((x.lq, nb), bool).at[jnp.arange(x.lq)[:, None], idx].max(chosen)
    keep = sel[:, k_pos // block_size]
    if causal:
        keep = keep | (k_pos[None, :] // block_size == q_pos[:, None] // block_size)
        keep = keep & (k_pos[None, :] <= q_pos[:, None])
    if kv_mask is not None:
        keep = keep & kv_mask[None, :]
    s = jnp.where(keep, qf @ x.k.astype(STATS_DTYPE).T * scale, -jnp.inf)
    p = jnp.where(keep, jnp.exp(s - safe_max(s.max(-1, keepdims=True))), 0.0)
    out = p @ x.v.astype(STATS_DTYPE) / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return out.astype(q.dtype)


def gathered_block_attention(q, k, v, index, chosen, *, block_size: int, kv_mask=None,
                             scale: float, chunk: int = 256):
    """Softmax attention of each query over only the key blocks it chose: ``q [Lq, D]``,
    ``index int32[Lq, n]`` blocks of ``k [Lk, D]``, ``v [Lk, Dv]`` (``chosen [Lq, n]`` marks
    the real choices). Gathers ``n`` blocks per query, ``chunk`` queries at a time under
    ``jax.checkpoint`` (the backward recomputes the gathers). Returns ``(out f32[Lq, Dv], lse
    f32[Lq])``; a query with no choice gives zeros and ``-inf``."""
    lq, lk, n = q.shape[0], k.shape[0], index.shape[1]
    nb = cdiv(lk, block_size)
    kb = pad_to(k, nb * block_size).reshape(nb, block_size, -1)
    vb = pad_to(v, nb * block_size).reshape(nb, block_size, -1)
    real = jnp.ones((lk,), bool) if kv_mask is None else kv_mask
    mb = pad_to(real, nb * block_size, value=False).reshape(nb, block_size)
    cq = min(chunk, lq)
    nc = cdiv(lq, cq)
    qs = pad_to(q, nc * cq).reshape(nc, cq, -1)
    ids = pad_to(index, nc * cq).reshape(nc, cq, n)
    chs = pad_to(chosen, nc * cq, value=False).reshape(nc, cq, n)

    @jax.checkpoint
    def one(args):
        qc, ic, cc = args
        kg, vg = kb[ic], vb[ic]  # [cq, n, bs, D]
        keep = (mb[ic] & cc[..., None]).reshape(cq, n * block_size)
        s = jnp.einsum("qd,qnbd->qnb", qc, kg, preferred_element_type=STATS_DTYPE)
        s = jnp.where(keep, s.reshape(cq, -1) * scale, -jnp.inf)
        m = safe_max(s.max(-1, keepdims=True))
        p = jnp.where(keep, jnp.exp(s - m), 0.0)
        l = p.sum(-1, keepdims=True)
        o = jnp.einsum("qnb,qnbd->qd", p.reshape(cq, n, block_size).astype(v.dtype), vg,
                       preferred_element_type=STATS_DTYPE)
        lse = jnp.where(l[:, 0] > 0, m[:, 0] + jnp.log(jnp.maximum(l[:, 0], 1e-30)), -jnp.inf)
        return o / jnp.maximum(l, 1e-30), lse

    out, lse = jax.lax.map(one, (qs, ids, chs))
    return out.reshape(nc * cq, -1)[:lq], lse.reshape(-1)[:lq]


def _block_schedule(index, chosen, nb: int, tile: int, group: int):
    """The (query, block) pairs sorted by block and cut into tiles of ``tile`` queries of one
    key block: ``(block int32[T], query int32[T, tile], slot int32[Lq n])`` with ``T`` a static
    bound (``Lq n / tile + nb`` rounded up to ``group``). A tile's unused rows name query
    ``Lq`` (a zero row the kernels append); ``slot`` is each pair's row among the ``T tile``
    tile rows (a permutation, so both directions are gathers)."""
    lq, n = index.shape
    pairs = lq * n
    blk = jnp.where(chosen, index, nb).reshape(pairs)  # not chosen: a block past the last
    # Sorted position -> pair: one sort of the distinct packed keys (block, pair) when they
    # fit in int32, rather than a stable sort carrying a second operand.
    if pairs * (nb + 1) < 2 ** 31:
        order = jax.lax.sort(blk * pairs + jnp.arange(pairs, dtype=blk.dtype)) % pairs
    else:
        order = jnp.argsort(blk, stable=True)
    counts = jnp.zeros((nb + 1,), jnp.int32).at[blk].add(1)[:nb]
    starts = jnp.cumsum(counts) - counts
    tiles_of = (counts + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles_of)
    num_tiles = cdiv(cdiv(pairs, tile) + nb, group) * group
    t = jnp.arange(num_tiles)
    tb = jnp.searchsorted(tile_ends, t, side="right")  # block of tile t (nb: unused)
    tbc = jnp.minimum(tb, nb - 1)
    local = t - (tile_ends - tiles_of)[tbc]
    count = jnp.where(tb < nb, jnp.clip(counts[tbc] - local * tile, 0, tile), 0)
    rows = (starts[tbc] + local * tile)[:, None] + jnp.arange(tile)
    valid = jnp.arange(tile)[None, :] < count[:, None]
    pair = order[jnp.clip(rows, 0, pairs - 1)]  # [T, tile]
    flat = jnp.where(valid, pair, pairs).reshape(-1)
    slot = jnp.zeros((pairs,), jnp.int32).at[flat].set(jnp.arange(num_tiles * tile,
                                                                  dtype=jnp.int32),
                                                       mode="drop")
    query = jnp.where(valid, pair // n, lq).astype(jnp.int32)
    return tbc.astype(jnp.int32), query, slot


def _blocks(static, q, k, v, mb):
    """Keys and values as ``[nb, block_size, D]`` blocks, and the queries with the zero row
    ``Lq`` appended (that tiles' unused rows read), scaled when float32."""
    scale, block_size = static[:2]
    nb = mb.shape[0]
    kb = pad_to(k, nb * block_size).reshape(nb, block_size, -1)
    vb = pad_to(v, nb * block_size).reshape(nb, block_size, -1)
    if q.dtype == jnp.float32:  # the scale applied to q once, as the tiled kernel does
        q = q * scale
    return jnp.concatenate([q, jnp.zeros((1, q.shape[1]), q.dtype)]), kb, vb


def _tile_scores(static, q, kb, b, qi):
    """One step's ``group`` tiles: the gathered queries ``[group, tile, D]`` and their scaled
    scores against their key block ``[group, tile, block_size]``."""
    qg = q[qi]
    s = jnp.einsum("gcd,gbd->gcb", qg, kb[b], preferred_element_type=STATS_DTYPE)
    return qg, (s if q.dtype == jnp.float32 else s * static[0])


def _selected_forward(static, q, k, v, extra, dyn):
    _, _, group, masked = static
    lq = q.shape[0]
    mb, tbc, query, slot, picked = dyn
    n = picked.shape[1]
    qe, kb, vb = _blocks(static, q, k, v, mb)
    g = tbc.shape[0] // group

    def one(args):
        b, qi = args  # [group], [group, tile]
        _, s = _tile_scores(static, qe, kb, b, qi)
        if masked:  # padded or masked keys (a full block needs no mask, as in flash)
            keep = mb[b][:, None, :]
            s = jnp.where(keep, s, -jnp.inf)
        m = safe_max(s.max(-1, keepdims=True))
        p = jnp.exp(s - m)
        if masked:
            p = jnp.where(keep, p, 0.0)
        acc = jnp.einsum("gcb,gbd->gcd", p.astype(v.dtype), vb[b],
                         preferred_element_type=STATS_DTYPE)
        return m[..., 0], p.sum(-1), acc

    tile = query.shape[1]
    m, l, acc = jax.lax.map(one, (tbc.reshape(g, group), query.reshape(g, group, tile)))
    flat = picked.reshape(-1)
    m = jnp.where(flat, m.reshape(-1)[slot], -jnp.inf).reshape(lq, n)
    l = jnp.where(flat, l.reshape(-1)[slot], 0.0).reshape(lq, n)
    acc = jnp.where(flat[:, None], acc.reshape(-1, acc.shape[-1])[slot], 0.0).reshape(lq, n, -1)
    top = safe_max(m.max(-1, keepdims=True))
    w = jnp.where(jnp.isfinite(m), jnp.exp(m - top), 0.0)
    total = (w * l).sum(-1)
    out = (w[..., None] * acc).sum(1) / jnp.maximum(total, 1e-30)[:, None]
    lse = jnp.where(total > 0, top[:, 0] + jnp.log(jnp.maximum(total, 1e-30)), -jnp.inf)
    return out, lse


def _selected_backward(static, q, k, v, extra, dyn, out, lse, d_out, d_lse):
    scale, block_size, group, masked = static
    lq, lk = q.shape[0], k.shape[0]
    mb, tbc, query, slot, picked = dyn
    nb, n = mb.shape[0], picked.shape[1]
    qe, kb, vb = _blocks(static, q, k, v, mb)
    d_out = d_out.astype(STATS_DTYPE)
    # FlashAttention's backward per tile, with the query's final log-sum-exp: p = exp(s - lse),
    # ds = p (dO . v - delta), delta = dO . out - d_lse (the lse's own cotangent). The zero
    # query row Lq gets lse = +inf, so an unused tile row has p = 0 and adds nothing.
    delta = (d_out * out).sum(-1) - d_lse
    lse_e = jnp.concatenate([jnp.where(jnp.isfinite(lse), lse, 0.0), jnp.full((1,), jnp.inf)])
    delta_e = jnp.concatenate([delta, jnp.zeros((1,), delta.dtype)])
    d_out_e = jnp.concatenate([d_out, jnp.zeros((1, d_out.shape[1]), d_out.dtype)])
    g = tbc.shape[0] // group
    tile = query.shape[1]

    # The tiles are computed transposed, s^T [block_size, tile], so that each of the five
    # products is a plain matmul or contracts the last axes of both operands (as the tiled
    # kernel's backward does): in the natural orientation p^T dO and ds^T q contract the
    # leading axis of both, which XLA:CPU runs through its slow generic dot.
    kbt = jnp.swapaxes(kb, 1, 2)  # [nb, D, block_size]

    def one(carry, args):
        dk, dv = carry
        b, qi = args
        qg = qe[qi]  # [group, tile, D]
        kg = kb[b]
        st = jnp.einsum("gbd,gcd->gbc", kg, qg, preferred_element_type=STATS_DTYPE)
        if qe.dtype != jnp.float32:
            st = st * scale
        pt = jnp.exp(st - lse_e[qi][:, None, :])
        if masked:
            pt = jnp.where(mb[b][:, :, None], pt, 0.0)
        dog = d_out_e[qi]
        dv = dv.at[b].add(jnp.einsum("gbc,gcd->gbd", pt, dog))
        dpt = jnp.einsum("gbd,gcd->gbc", vb[b].astype(STATS_DTYPE), dog)
        dst = pt * (dpt - delta_e[qi][:, None, :])
        dqt = jnp.einsum("gdb,gbc->gdc", kbt[b].astype(STATS_DTYPE), dst)
        dk = dk.at[b].add(jnp.einsum("gbc,gcd->gbd", dst, qg.astype(STATS_DTYPE)))
        return (dk, dv), dqt

    # Each key block's gradient is added in place as its tiles come (a few whole-block rows
    # per step), not kept per tile: the per-tile buffers were 2 T tile D numbers more memory.
    zeros = (jnp.zeros(kb.shape, STATS_DTYPE), jnp.zeros(vb.shape, STATS_DTYPE))
    (dk, dv), dqt = jax.lax.scan(one, zeros, (tbc.reshape(g, group),
                                              query.reshape(g, group, tile)))
    dq = jnp.swapaxes(dqt.reshape(-1, *dqt.shape[2:]), 1, 2)  # [T, tile, D]
    flat = picked.reshape(-1)
    dq = jnp.where(flat[:, None], dq.reshape(-1, dq.shape[-1])[slot], 0.0)
    dq = dq.reshape(lq, n, -1).sum(1) * scale
    # (dk's scale is in the scaled queries when float32.)
    dk = dk.reshape(nb * block_size, -1)[:lk] * (1.0 if q.dtype == jnp.float32 else scale)
    dv = dv.reshape(nb * block_size, -1)[:lk]
    return dq, dk, dv, ()


_selected = lse_vjp(_selected_forward, _selected_backward)


def selected_blocks_attention(q, k, v, index, chosen, *, block_size: int, kv_mask=None,
                              scale: float, tile: int = 128, group: int = 8):
    """Softmax attention of each query over only the key blocks it chose, key block by key
    block: ``q [Lq, D]``, ``index int32[Lq, n]`` blocks of ``k [Lk, D]``, ``v [Lk, Dv]``
    (``chosen [Lq, n]`` marks the real choices). Returns ``(out f32[Lq, Dv], lse f32[Lq])``;
    a query with no choice gives zeros and ``-inf``.

    The ``Lq n`` (query, block) pairs are sorted by block; each block's queries are cut into
    tiles of ``tile`` rows, so one tile is a ``[tile, D] x [D, block_size]`` matmul against one
    contiguous block of keys (MoBA's own kernel groups its queries by block the same way).
    Gathering queries (``D`` numbers per pair) rather than each query's blocks (``block_size
    D``) keeps the memory traffic ``block_size`` times lower. There are at most ``Lq n / tile +
    nb`` tiles (a static bound); ``group`` tiles run per step of a ``lax.map``. Each (query,
    block) pair is an exact partial softmax (its maximum, sum and weighted values); the pairs
    merge per query by their log-sum-exps. Without ``kv_mask`` and with whole blocks, no tile
    carries a mask (a tile's unused rows read a zero query whose results are never read, and
    whose backward probabilities are 0).

    Gradients: the tiled kernel's recomputing VJP (``kernels.lse_vjp``; FlashAttention's
    backward, Dao et al. 2022): the forward saves only ``out`` and ``lse``, the backward
    recomputes each tile's probabilities as ``exp(s - lse)`` from the query's final
    log-sum-exp. Every move of a pair's row is a gather (the sort is a permutation, and its
    inverse ``slot`` is kept); each key block's gradient is added in place, whole block rows
    at a time, as its tiles come: no scatter-add of per-pair rows, which XLA:CPU runs
    serially.
    """
    lk = k.shape[0]
    nb = cdiv(lk, block_size)
    real = jnp.ones((lk,), bool) if kv_mask is None else kv_mask
    mb = pad_to(real, nb * block_size, value=False).reshape(nb, block_size)
    masked = kv_mask is not None or lk % block_size != 0
    if kv_mask is not None:  # a NaN in a masked key or value must not reach a 0 * x product
        k = jnp.where(kv_mask[:, None], k, jnp.zeros((), k.dtype))
        v = jnp.where(kv_mask[:, None], v, jnp.zeros((), v.dtype))
    tbc, query, slot = _block_schedule(index, chosen, nb, tile, group)
    return _selected((float(scale), block_size, group, masked), q, k, v, (),
                     (mb, tbc, query, slot, chosen))


def moba_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *,
    block_size: int = 64,
    top_k: int = 3,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    key=None,
    chunk: int = 256,
    implementation: str | None = None,
) -> Float[Array, "q_seq v_dim"]:
    """MoBA for one head (Lu et al., 2025): each query attends over the ``top_k`` key blocks
    its gate picks, computing only those blocks.

    Args:
      q: ``[Lq, D]``. k: ``[Lk, D]``. v: ``[Lk, Dv]``.
      block_size: keys per block. top_k: blocks per query (causal: its own block and
        ``top_k - 1`` chosen past blocks).
      causal, kv_mask, key: the contract's (self-attention positions when causal: query ``i``
        at position ``i``). scale: ``1/sqrt(D)`` by default.
      chunk: query rows per tile of one chosen key block (:func:`selected_blocks_attention`'s
        ``tile``). implementation: the tiled kernel's, for the own block.

    Returns:
      ``[Lq, Dv]`` in q's dtype, equal to :func:`moba_reference`.
    """
    name = "moba_attention"
    _check(name, block_size, top_k)
    C.check_positive_int(name, "chunk", chunk)
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    if causal and x.lq != x.lk:
        raise ValueError(f"{name}: causal=True is self-attention (query i at position i); got "
                         f"q{tuple(q.shape)}, k{tuple(k.shape)}")
    scale = C.resolve_scale(x.dk, scale)
    pooled, real = pooled_blocks(x.k, kv_mask, block_size)
    gates = jnp.einsum("qd,nd->qn", x.q, pooled.astype(x.q.dtype),
                       preferred_element_type=STATS_DTYPE)
    idx, chosen = select_blocks(gates, real, jnp.arange(x.lq), block_size, top_k, causal)
    out = chosen_and_own_blocks(x.q, x.k, x.v, idx, chosen, block_size=block_size,
                                kv_mask=kv_mask, scale=scale, causal=causal, chunk=chunk,
                                implementation=implementation)
    return out.astype(q.dtype)


def chosen_and_own_blocks(q, k, v, index, chosen, *, block_size: int, kv_mask, scale: float,
                          causal: bool, chunk: int, implementation):
    """The attention over the chosen past blocks (:func:`selected_blocks_attention`) merged by
    log-sum-exp with, when causal, the query's own block (always kept; on the tiled kernel):
    ``[Lq, Dv]``. MoBA's output and NSA's selected branch."""
    parts = []
    if index.shape[1]:
        parts.append(selected_blocks_attention(q, k, v, index, chosen, block_size=block_size,
                                               kv_mask=kv_mask, scale=scale, tile=chunk))
    if causal:
        parts.append(flash_attention(q, k, v, causal=True, kv_mask=kv_mask,
                                     pattern=BlockLocal(block_size), scale=scale,
                                     return_lse=True, implementation=implementation))
    return parts[0][0] if len(parts) == 1 else merge_by_lse(*parts[0], *parts[1])[0]
