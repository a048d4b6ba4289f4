"""Sparse Sinkhorn attention: a learned sort of key blocks, then local + sorted block attention.

Tay, Bahri, Yang, Metzler & Juan, "Sparse Sinkhorn Attention" (ICML 2020).

Blocks are contiguous runs of ``block_size`` tokens (the Long Range Arena code reshapes
``(L,) -> (block, num_blocks)``, which makes strided sets, and its einsum never applies the
sort; here the keys and values really are permuted by the sort matrix, which tests check
against an explicit permutation).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from ... import kernels


# On CPU, when one head's block scores (all query blocks together) would exceed
# _CPU_GROUP_ABOVE_BYTES, the query blocks are attended to in groups of _CPU_GROUP_BLOCKS,
# each group's scores recomputed in the backward rather than stored, so the working set stays
# in cache and time grows linearly with L. Measured fwd+bwd on the 2-core EPYC:
# - 4 heads, D=64, block 128, hard sort (8.4 MB of scores per head at L=8K, 34 MB at 32K):
#   all at once 193 ms at 8K and 869 at 32K; in groups of 16, 156 and 667 ms, with 13% / 26%
#   less compiled memory (154 against 178 MB, 533 against 724 MB).
# - the LRA Text step at L=4097 (block 64, soft sort, 2 x 4 heads, 2.1 MB per head): all at
#   once 425-445 ms and 323 MB compiled; in groups of 16, 475-482 ms and 339 MB (the loop's
#   buffers outweigh the scores it saves).
# Accelerators take all blocks at once. _CPU_GROUP_BLOCKS = None: all at once everywhere.
_CPU_GROUP_BLOCKS: int | None = 16
_CPU_GROUP_ABOVE_BYTES = 4 * 2**20


def _block_group(n: int, b: int, keys_per_query: int) -> int | None:
    """Query blocks per group for ``n`` blocks of ``b`` queries that each score
    ``keys_per_query`` keys, or None for all blocks at once (see _CPU_GROUP_BLOCKS)."""
    group = _CPU_GROUP_BLOCKS
    if jax.default_backend() != "cpu" or group is None or group >= n:
        return None
    return group if n * b * keys_per_query * 4 > _CPU_GROUP_ABOVE_BYTES else None


class SinkhornSortNet(NamedTuple):
    """The meta sorting network (a two-layer ReLU MLP; ``F_S`` in Eq. 4 of Tay et al., 2020,
    "Efficient Transformers: A Survey") mapping a block's summary ``[D]`` to its logits over the
    ``num_blocks`` blocks."""

    w1: jax.Array  # [D, hidden]
    b1: jax.Array  # [hidden]
    w2: jax.Array  # [hidden, num_blocks]
    b2: jax.Array  # [num_blocks]


def init_sinkhorn_sort_net(key, dim: int, num_blocks: int, hidden: int | None = None):
    """A :class:`SinkhornSortNet` for keys of size ``dim`` and ``num_blocks`` blocks (LeCun
    normal weights, zero biases). ``hidden`` defaults to ``dim``."""
    name = "init_sinkhorn_sort_net"
    dim = C.check_positive_int(name, "dim", dim)
    num_blocks = C.check_positive_int(name, "num_blocks", num_blocks)
    hidden = C.check_positive_int(name, "hidden", hidden or dim)
    k1, k2 = jax.random.split(key)
    init = jax.nn.initializers.lecun_normal()
    return SinkhornSortNet(
        init(k1, (dim, hidden), jnp.float32), jnp.zeros((hidden,), jnp.float32),
        init(k2, (hidden, num_blocks), jnp.float32), jnp.zeros((num_blocks,), jnp.float32),
    )


def gumbel_sinkhorn(logits, *, temperature: float = 0.75, iterations: int = 8, key=None):
    """Gumbel-Sinkhorn (Mena et al. 2018): a soft permutation matrix ``f32[n, n]``.

    ``(logits + Gumbel noise drawn from key, if given) / temperature``, then ``iterations``
    rounds of row and column normalisation in log space. The result approaches a doubly
    stochastic matrix as ``iterations`` grows and a permutation as ``temperature -> 0``.
    """
    if temperature <= 0:
        raise ValueError(f"gumbel_sinkhorn: temperature must be positive but got {temperature}")
    iterations = C.check_positive_int("gumbel_sinkhorn", "iterations", iterations)
    z = logits.astype(jnp.float32)
    if key is not None:
        z = z + jax.random.gumbel(key, z.shape, jnp.float32)
    z = z / temperature
    for _ in range(iterations):
        z = z - jax.nn.logsumexp(z, axis=1, keepdims=True)
        z = z - jax.nn.logsumexp(z, axis=0, keepdims=True)
    return jnp.exp(z)


def _greedy_assignment(p):
    """``int32[n]``: row i's column in the permutation :func:`hard_permutation` builds.

    The greedy matching (largest entry first, ties to the smaller flat index) in rounds: an
    entry that is the largest of both its row and its column among the rows and columns
    still free is one greedy takes (every larger entry left lies in other rows and columns),
    so each round takes all of them at once. A round is O(n^2); the global maximum is taken
    every round, so there are at most n rounds; on Sinkhorn matrices about log2 n (the
    one-entry-at-a-time loop was n rounds of O(n^2), 0.4 s for 4 heads at n=256).
    """
    n = p.shape[0]
    p = jax.lax.stop_gradient(p)
    ar = jnp.arange(n, dtype=jnp.int32)

    def cond(carry):
        row_free, _, _, rounds = carry
        return row_free.any() & (rounds < n)  # the bound only matters for NaN input

    def step(carry):
        row_free, col_free, idx, rounds = carry
        m = jnp.where(row_free[:, None] & col_free[None, :], p, -jnp.inf)
        best_col = jnp.argmax(m, axis=1).astype(jnp.int32)  # first index: smaller flat index
        best_row = jnp.argmax(m, axis=0).astype(jnp.int32)
        take_row = row_free & (best_row[best_col] == ar)
        take_col = col_free & row_free[best_row] & (best_col[best_row] == ar)
        return (row_free & ~take_row, col_free & ~take_col,
                jnp.where(take_row, best_col, idx), rounds + 1)

    init = (jnp.ones((n,), bool), jnp.ones((n,), bool), jnp.zeros((n,), jnp.int32), 0)
    return jax.lax.while_loop(cond, step, init)[2]


def hard_permutation(p):
    """The permutation matrix greedily closest to ``p [n, n]``: repeatedly take the largest
    remaining entry and retire its row and column."""
    return jax.nn.one_hot(_greedy_assignment(p), p.shape[0], dtype=p.dtype)


def _sort_net(net: SinkhornSortNet, summary):
    h = jax.nn.relu(summary @ net.w1.astype(jnp.float32) + net.b1)
    return h @ net.w2.astype(jnp.float32) + net.b2


def _sort(k, sort_net, *, block_size, causal, kv_mask, temperature, iterations, hard, key):
    """The soft sort matrix ``f32[n, n]`` and, when ``hard``, each row's chosen block
    (``int32[n]``) and whether the row has one (``bool[n]``: False only for causal row 0);
    ``None, None`` otherwise."""
    n = jnp.asarray(sort_net.w2).shape[1]
    length, dim = k.shape
    padded = n * block_size
    real = jnp.ones((length,), bool) if kv_mask is None else kv_mask
    k0 = jnp.where(real[:, None], k.astype(jnp.float32), 0.0)
    sums = jnp.pad(k0, ((0, padded - length), (0, 0))).reshape(n, block_size, dim).sum(1)
    if not causal:
        p = gumbel_sinkhorn(_sort_net(sort_net, sums), temperature=temperature,
                            iterations=iterations, key=key)
        if not hard:
            return p, None, None
        return p, _greedy_assignment(p), jnp.ones((n,), bool)
    # Exclusive prefix sums by shifting: cumsum - sums would round with block i's own (partly
    # future) content.
    past = jnp.concatenate([jnp.zeros_like(sums[:1]), jnp.cumsum(sums, axis=0)[:-1]])
    logits = _sort_net(sort_net, past)
    if key is not None:
        logits = logits + jax.random.gumbel(key, logits.shape, jnp.float32)
    earlier = jnp.tril(jnp.ones((n, n), bool), k=-1)
    z = jnp.where(earlier, logits / temperature, -jnp.inf)
    p = jnp.where(earlier, jax.nn.softmax(jnp.where(earlier, z, -1e30), axis=-1), 0.0)
    if not hard:
        return p, None, None
    idx = jnp.argmax(z, axis=-1).astype(jnp.int32)
    return p, idx, earlier[jnp.arange(n), idx]


def sinkhorn_sort_matrix(k, sort_net, *, block_size: int, causal: bool = False, kv_mask=None,
                         temperature: float = 0.75, iterations: int = 8, hard: bool = False,
                         key=None):
    """The block sort matrix ``f32[num_blocks, num_blocks]`` :func:`sinkhorn_attention` uses.

    Row i says which key blocks fill sorted block i. Non-causal: Gumbel-Sinkhorn of the sort
    net applied to each block's key sum. Causal: row i sees only the sum of the blocks before
    it and only those blocks, and is normalised over its row alone (a column normalisation
    would let later blocks change earlier rows); row 0 is empty. ``hard=True`` gives a 0/1
    matrix (a permutation, or one block per row when causal) with straight-through gradients.
    """
    p, idx, valid = _sort(k, sort_net, block_size=block_size, causal=causal, kv_mask=kv_mask,
                          temperature=temperature, iterations=iterations, hard=hard, key=key)
    if not hard:
        return p
    one = jax.nn.one_hot(idx, p.shape[0], dtype=jnp.float32) * valid[:, None]
    # one + (p - p): exactly 0/1 forward (p + (one - p) would round), p's gradient backward.
    return one + (p - jax.lax.stop_gradient(p))


@jax.custom_vjp
def _st_gather(p, idx, valid, inv, cand, x):
    """``H @ x`` for the hard sort matrix ``H = one_hot(idx) * valid`` with the
    straight-through gradient of ``H + (p - stop_gradient(p))``, without the dense product.

    ``p: f32[r, n]`` (soft rows), ``idx: int32[r]``, ``valid: bool[r]``, ``x: [n, b, d]`` ->
    ``[r, b, d]``. ``inv``: None, or ``int32[n]`` when the hard sort is a permutation: the row
    that takes block j (``>= r`` when none of these rows does). ``cand``: None, or
    ``int32[r, c]``, the columns of p that get a gradient.

    Forward: a gather, O(r b d). Backward: ``dx = H^T g`` (a gather through ``inv``, else a
    scatter-add), O(n b d); ``dp[i, j] = <g_i, x_j>`` is the straight-through gradient, for
    every j (one ``[r, bd] x [bd, n]`` matmul) when ``cand`` is None, else for the columns
    ``cand[i]`` only (O(r c b d)) and 0 elsewhere.
    """
    return _st_gather_fwd(p, idx, valid, inv, cand, x)[0]


def _st_gather_fwd(p, idx, valid, inv, cand, x):
    del p  # only its gradient matters
    out = jnp.where(valid[:, None, None], jnp.take(x, idx, axis=0), jnp.zeros((), x.dtype))
    return out, (idx, valid, inv, cand, x)


def _st_gather_bwd(res, g):
    idx, valid, inv, cand, x = res
    rows, n = idx.shape[0], x.shape[0]
    if cand is None:
        dp = jnp.einsum("itd,jtd->ij", g, x, preferred_element_type=jnp.float32)
    else:
        # One candidate slot at a time (a loop, so one [r, b, d] buffer is reused): gathering
        # all of them at once is a [r, c, b, d] copy, and unrolled slots were 5x slower on CPU.
        def slot(cols):
            return jnp.einsum("itd,itd->i", g, jnp.take(x, cols, axis=0),
                              preferred_element_type=jnp.float32)

        vals = jax.lax.map(slot, cand.T).T
        dp = jnp.zeros((rows, n), jnp.float32).at[jnp.arange(rows)[:, None], cand].add(vals)
    gv = jnp.where(valid[:, None, None], g, jnp.zeros((), g.dtype))
    if inv is None:
        dx = jnp.zeros(x.shape, jnp.float32).at[idx].add(gv.astype(jnp.float32))
        dx = dx.astype(x.dtype)
    else:
        dx = jnp.where((inv < rows)[:, None, None],
                       jnp.take(gv, jnp.minimum(inv, rows - 1), axis=0), 0.0).astype(x.dtype)
    return dp, None, None, None, None, dx


_st_gather.defvjp(_st_gather_fwd, _st_gather_bwd)


def sinkhorn_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    sort_net: SinkhornSortNet,
    *,
    block_size: int,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    temperature: float = 0.75,
    iterations: int = 8,
    hard: bool = False,
    straight_through_top: int | None = None,
    sortcut: int | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Sparse Sinkhorn attention for one sequence and one head.

    The sequence is cut into ``num_blocks`` contiguous blocks (padded to whole blocks). The
    sort matrix P (:func:`sinkhorn_sort_matrix`) permutes the key and value blocks:
    ``sorted_k[i] = sum_j P[i, j] k_block[j]``. Query block i attends jointly to its own key
    block (local attention) and to sorted block i. With ``sortcut=n`` every query attends
    instead to the first ``n`` sorted blocks only (SortCut), O(L * n * block_size).

    Padded keys (``kv_mask``) are zeroed before the block sums and the sort, and a sorted key
    carries the weight ``sum_j P[i, j] * real[j]`` as a log bias, so padding changes nothing.
    ``causal=True``: the local block is causally masked and sorted block i mixes only blocks
    before i (see :func:`sinkhorn_sort_matrix`), so nothing depends on later tokens.

    Cost: the block attention is O(L * block_size * D). Building the sort matrix is
    O(num_blocks^2) per Sinkhorn iteration, and the hard permutation O(num_blocks^2) per
    greedy round (about log2(num_blocks) rounds on Sinkhorn matrices, at most num_blocks).
    Applying it:

    - soft (the paper's sort, the default): P is dense, so mixing whole blocks is
      ``num_blocks^2 * block_size * D = L^2 D / block_size`` work, three such matmuls per
      tensor in the forward and backward. Quadratic; at L=32768 and block 128 it costs as
      much as the block attention itself. With ``sortcut`` only the first ``sortcut`` rows
      are mixed, O(sortcut * L * D): linear.
    - ``hard=True``: the forward gathers the chosen block per row, O(L D), and the backward
      scatters its gradient back, O(L D). The straight-through gradient to P,
      ``dL/dP[i, j] = <dL/dsorted_i, block_j>``, needs every (i, j) pair: one
      ``L^2 D / block_size`` matmul per tensor in the backward. ``straight_through_top=c``
      computes it only for the ``c`` largest entries of each row of P (0 elsewhere),
      O(c L D), which makes the whole call linear in L. P is ``exp`` of the last log-space
      Sinkhorn iterate (or of the causal log-softmax), so everything upstream of P sees
      ``dL/dP`` only through ``P * dL/dP``: the entries left out are the ones weighted least,
      the sort net's gradient misses only the terms ``P[i, j] * <dL/dsorted_i, block_j>`` of
      the dropped j, and nothing when those entries of P are 0. The forward and the
      gradients to q and v are unchanged; k's differs only on its path through the sort.

    Args:
      q: ``[L, Dk]``. k: ``[L, Dk]``. v: ``[L, Dv]``.
      sort_net: :class:`SinkhornSortNet` from :func:`init_sinkhorn_sort_net`; its
        ``num_blocks`` must equal ``ceil(L / block_size)``.
      block_size: tokens per block.
      causal: query i sees keys j <= i only.
      kv_mask: ``bool[L]``, True for real tokens.
      scale: score scale, ``1/sqrt(Dk)`` by default.
      temperature, iterations: Gumbel-Sinkhorn settings.
      hard: use a hard permutation (straight-through gradients).
      straight_through_top: with ``hard``, the number of largest entries per row of the soft
        sort matrix that receive the straight-through gradient (None, or at least
        ``num_blocks``: all of them, the exact straight-through gradient).
      sortcut: attend to the first ``sortcut`` sorted blocks only (not with ``causal``).
      key: PRNG key for the Gumbel noise (training); no noise without it.

    Returns:
      ``[L, Dv]`` in q's dtype.
    """
    name = "sinkhorn_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    b = C.check_positive_int(name, "block_size", block_size)
    scale = C.resolve_scale(x.dk, scale)
    C.check_same_length(name, x, "query block i pairs with key block i, so Lq must equal Lk")
    w2 = jnp.asarray(sort_net.w2)
    n = -(-x.lq // b)
    if jnp.asarray(sort_net.w1).shape[0] != x.dk or w2.shape[1] != n:
        raise ValueError(
            f"{name}: L={x.lq} with block_size={b} gives {n} blocks of Dk={x.dk}, but the sort "
            f"net maps {jnp.asarray(sort_net.w1).shape[0]} -> {w2.shape[1]} blocks"
        )
    if straight_through_top is not None:
        if not hard:
            raise ValueError(
                f"{name}: straight_through_top={straight_through_top} applies to the hard sort "
                "only (hard=True); the soft sort's gradient is exact")
        straight_through_top = C.check_positive_int(
            name, "straight_through_top", straight_through_top)
    if sortcut is not None:
        if causal:
            C.causal_unsupported(
                name + " with sortcut", "every query attends to the same first sorted blocks, "
                "which mix the whole sequence")
        sortcut = C.check_positive_int(name, "sortcut", sortcut)
        if sortcut > n:
            raise ValueError(f"{name}: sortcut={sortcut} exceeds the {n} blocks")
    p, idx, valid = _sort(x.k, sort_net, block_size=b, causal=causal, kv_mask=kv_mask,
                          temperature=temperature, iterations=iterations, hard=hard, key=key)
    padded = n * b
    real = jnp.ones((x.lk,), bool) if kv_mask is None else kv_mask
    real_b = jnp.pad(real, (0, padded - x.lk)).reshape(n, b)

    def blocks(a):
        a = jnp.where(real[:, None], a, jnp.zeros_like(a))
        return jnp.pad(a, ((0, padded - a.shape[0]), (0, 0))).reshape(n, b, -1)

    qb, kb, vb = blocks(x.q), blocks(x.k), blocks(x.v)
    # Only the sorted blocks that are used: all of them, or SortCut's first ones.
    rows = n if sortcut is None else sortcut
    p = p[:rows]
    if hard:
        cand = None
        if straight_through_top is not None and straight_through_top < n:
            cand = jax.lax.top_k(jax.lax.stop_gradient(p), straight_through_top)[1]
        inv = None
        if not causal:  # a permutation: its transpose is a gather
            inv = jnp.zeros((n,), jnp.int32).at[idx].set(jnp.arange(n, dtype=jnp.int32))
        idx, valid = idx[:rows], valid[:rows]
        sk = _st_gather(p, idx, valid, inv, cand, kb)
        sv = _st_gather(p, idx, valid, inv, cand, vb)
        sw = _st_gather(p, idx, valid, inv, cand, real_b.astype(jnp.float32)[..., None])[..., 0]
    else:
        pc = p.astype(x.k.dtype)
        sk = jnp.einsum("ij,jtd->itd", pc, kb,
                        preferred_element_type=C.STATS_DTYPE).astype(x.k.dtype)
        sv = jnp.einsum("ij,jtd->itd", pc, vb,
                        preferred_element_type=C.STATS_DTYPE).astype(x.v.dtype)
        sw = jnp.einsum("ij,jt->it", p, real_b.astype(jnp.float32))
    s_bias = jnp.where(sw > 0, jnp.log(jnp.where(sw > 0, sw, 1.0)), -jnp.inf)

    # Query block i sees its local block (causally masked when causal) and sorted block i, or
    # SortCut's shared first sorted blocks. The two key sets are scored separately and share
    # one softmax (no [n, 2b, D] concatenation of keys and values; SortCut's keys are one
    # shared operand, not a copy per query block).
    tril = jnp.tril(jnp.ones((b, b), bool))

    def one_block(args):
        """Query block i's output from its own slices ``args`` (and SortCut's shared keys)."""
        if sortcut is None:
            qi, ki, vi, real_i, ski, svi, s_bias_i = args
            local_ok = (real_i[None, :] & tril) if causal else real_i[None, :]
            keysets = [(ki, vi, jnp.where(local_ok, 0.0, -jnp.inf)), (ski, svi, s_bias_i)]
        else:
            (qi,) = args
            keysets = [(sk.reshape(sortcut * b, -1), sv.reshape(sortcut * b, -1),
                        s_bias.reshape(-1))]
        scores = [jnp.einsum("qd,kd->qk", qi, kk, preferred_element_type=C.STATS_DTYPE) * scale
                  + bias for kk, _, bias in keysets]
        m = jax.lax.stop_gradient(kernels.safe_max(
            functools.reduce(jnp.maximum, [sc.max(-1) for sc in scores])))
        es = [jnp.exp(sc - m[:, None]) for sc in scores]
        acc = sum(jnp.einsum("qk,kd->qd", e.astype(x.v.dtype), vv,
                             preferred_element_type=C.STATS_DTYPE)
                  for e, (_, vv, _) in zip(es, keysets))
        return kernels.normalise(acc, sum(e.sum(-1) for e in es))

    per_block = (qb, kb, vb, real_b, sk, sv, s_bias) if sortcut is None else (qb,)
    group = _block_group(n, b, 2 * b if sortcut is None else sortcut * b)
    if group is None:
        out = jax.vmap(one_block)(per_block)
    else:
        out = jax.lax.map(jax.checkpoint(one_block), per_block, batch_size=group)
    return out.reshape(padded, x.dv)[: x.lq].astype(x.q.dtype)
