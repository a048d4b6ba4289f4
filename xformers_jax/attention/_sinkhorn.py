"""Sparse Sinkhorn attention: a learned sort of key blocks, then local + sorted block attention.

Tay, Bahri, Yang, Metzler & Juan, "Sparse Sinkhorn Attention" (ICML 2020); survey P 4.1
(Fig 16), T1 3.2.11 (Eq 4), L 4.1.2.

Blocks are contiguous runs of ``block_size`` tokens (the Long Range Arena code reshapes
``(L,) -> (block, num_blocks)``, which makes strided sets, and its einsum never applies the
sort; here the keys and values really are permuted by the sort matrix, which tests check
against an explicit permutation).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _contract as C
from . import _tiles


class SinkhornSortNet(NamedTuple):
    """The meta sorting network F_S (a two-layer ReLU MLP, T1 Eq 4) mapping a block's summary
    ``[D]`` to its logits over the ``num_blocks`` blocks."""

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


def hard_permutation(p):
    """The permutation matrix greedily closest to ``p [n, n]``: repeatedly take the largest
    remaining entry and retire its row and column."""
    n = p.shape[0]

    def step(_, carry):
        remaining, perm = carry
        flat = jnp.argmax(remaining)
        i, j = flat // n, flat % n
        perm = perm.at[i, j].set(1.0)
        remaining = remaining.at[i, :].set(-jnp.inf).at[:, j].set(-jnp.inf)
        return remaining, perm

    _, perm = jax.lax.fori_loop(
        0, n, step, (jax.lax.stop_gradient(p), jnp.zeros_like(p))
    )
    return perm


def _sort_net(net: SinkhornSortNet, summary):
    h = jax.nn.relu(summary @ net.w1.astype(jnp.float32) + net.b1)
    return h @ net.w2.astype(jnp.float32) + net.b2


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
    n = jnp.asarray(sort_net.w2).shape[1]
    length, dim = k.shape
    padded = n * block_size
    real = jnp.ones((length,), bool) if kv_mask is None else kv_mask
    k0 = jnp.where(real[:, None], k.astype(jnp.float32), 0.0)
    sums = jnp.pad(k0, ((0, padded - length), (0, 0))).reshape(n, block_size, dim).sum(1)
    if not causal:
        p = gumbel_sinkhorn(_sort_net(sort_net, sums), temperature=temperature,
                            iterations=iterations, key=key)
        # hard + (p - p): exactly 0/1 forward (p + (hard - p) would round), p's gradient backward.
        return hard_permutation(p) + (p - jax.lax.stop_gradient(p)) if hard else p
    # Exclusive prefix sums by shifting: cumsum - sums would round with block i's own (partly
    # future) content.
    past = jnp.concatenate([jnp.zeros_like(sums[:1]), jnp.cumsum(sums, axis=0)[:-1]])
    logits = _sort_net(sort_net, past)
    if key is not None:
        logits = logits + jax.random.gumbel(key, logits.shape, jnp.float32)
    earlier = jnp.tril(jnp.ones((n, n), bool), k=-1)
    z = jnp.where(earlier, logits / temperature, -jnp.inf)
    p = jnp.where(earlier, jax.nn.softmax(jnp.where(earlier, z, -1e30), axis=-1), 0.0)
    if hard:
        one = jax.nn.one_hot(jnp.argmax(z, axis=-1), n, dtype=jnp.float32) * earlier
        return one + (p - jax.lax.stop_gradient(p))
    return p


def sinkhorn_attention(
    q,
    k,
    v,
    sort_net: SinkhornSortNet,
    *,
    block_size: int,
    causal: bool = False,
    kv_mask=None,
    scale: float | None = None,
    temperature: float = 0.75,
    iterations: int = 8,
    hard: bool = False,
    sortcut: int | None = None,
    key=None,
):
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

    Cost: the block attention is O(L * block_size); applying the soft sort mixes whole blocks,
    O(num_blocks^2 * block_size * D) = O(L^2 * D / block_size), a matmul that is quadratic
    but 1/block_size of dense attention's work (at L=32768, block 128: under 1%).

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
      sortcut: attend to the first ``sortcut`` sorted blocks only (not with ``causal``).
      key: PRNG key for the Gumbel noise (training); no noise without it.

    Returns:
      ``[L, Dv]`` in q's dtype.
    """
    name = "sinkhorn_attention"
    x = C.check_qkv(name, q, k, v)
    kv_mask = C.check_kv_mask(name, kv_mask, x.lk)
    b = C.check_positive_int(name, "block_size", block_size)
    scale = C.resolve_scale(x.dk, scale)
    if x.lq != x.lk:
        raise ValueError(
            f"{name}: query block i pairs with key block i, so Lq must equal Lk; got "
            f"q{tuple(x.q.shape)}, k{tuple(x.k.shape)}"
        )
    w2 = jnp.asarray(sort_net.w2)
    n = -(-x.lq // b)
    if jnp.asarray(sort_net.w1).shape[0] != x.dk or w2.shape[1] != n:
        raise ValueError(
            f"{name}: L={x.lq} with block_size={b} gives {n} blocks of Dk={x.dk}, but the sort "
            f"net maps {jnp.asarray(sort_net.w1).shape[0]} -> {w2.shape[1]} blocks"
        )
    if sortcut is not None:
        if causal:
            C.causal_unsupported(
                name + " with sortcut", "every query attends to the same first sorted blocks, "
                "which mix the whole sequence")
        sortcut = C.check_positive_int(name, "sortcut", sortcut)
        if sortcut > n:
            raise ValueError(f"{name}: sortcut={sortcut} exceeds the {n} blocks")
    p = sinkhorn_sort_matrix(x.k, sort_net, block_size=b, causal=causal, kv_mask=kv_mask,
                             temperature=temperature, iterations=iterations, hard=hard, key=key)
    padded = n * b
    real = jnp.ones((x.lk,), bool) if kv_mask is None else kv_mask
    real_b = jnp.pad(real, (0, padded - x.lk)).reshape(n, b)

    def blocks(a):
        a = jnp.where(real[:, None], a, jnp.zeros_like(a))
        return jnp.pad(a, ((0, padded - a.shape[0]), (0, 0))).reshape(n, b, -1)

    qb, kb, vb = blocks(x.q), blocks(x.k), blocks(x.v)
    pc = p.astype(x.k.dtype)
    sk = jnp.einsum("ij,jtd->itd", pc, kb, preferred_element_type=C.STATS_DTYPE).astype(x.k.dtype)
    sv = jnp.einsum("ij,jtd->itd", pc, vb, preferred_element_type=C.STATS_DTYPE).astype(x.v.dtype)
    sw = jnp.einsum("ij,jt->it", p, real_b.astype(jnp.float32))
    s_bias = jnp.where(sw > 0, jnp.log(jnp.where(sw > 0, sw, 1.0)), -jnp.inf)

    if sortcut is not None:
        keys = jnp.broadcast_to(sk[:sortcut].reshape(1, sortcut * b, -1), (n, sortcut * b, x.dk))
        vals = jnp.broadcast_to(sv[:sortcut].reshape(1, sortcut * b, -1), (n, sortcut * b, x.dv))
        bias = jnp.broadcast_to(s_bias[:sortcut].reshape(1, 1, -1), (n, b, sortcut * b))
    else:
        pos = jnp.arange(b)
        local_ok = real_b[:, None, :]
        if causal:
            local_ok = local_ok & (pos[None, :] <= pos[:, None])[None]
        local_bias = jnp.where(local_ok, 0.0, -jnp.inf)
        keys = jnp.concatenate([kb, sk], axis=1)
        vals = jnp.concatenate([vb, sv], axis=1)
        bias = jnp.concatenate(
            [jnp.broadcast_to(local_bias, (n, b, b)),
             jnp.broadcast_to(s_bias[:, None, :], (n, b, b))], axis=2)
    s = jnp.einsum("nqd,nkd->nqk", qb, keys, preferred_element_type=C.STATS_DTYPE) * scale + bias
    m = jax.lax.stop_gradient(_tiles.safe_max(s.max(-1)))
    e = jnp.exp(s - m[..., None])
    out = _tiles.normalise(
        jnp.einsum("nqk,nkd->nqd", e.astype(x.v.dtype), vals, preferred_element_type=C.STATS_DTYPE),
        e.sum(-1),
    )
    return out.reshape(padded, x.dv)[: x.lq].astype(x.q.dtype)
