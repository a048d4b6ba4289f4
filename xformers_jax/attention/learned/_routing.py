"""Routing attention: online spherical k-means routes queries and keys to clusters.

Roy, Saffar, Vaswani & Grangier, "Efficient Content-Based Sparse Attention with Routing
Transformers" (TACL 2021); survey T1 3.2.9, L 4.1.2 (Eq 8-11).

The centroids are not trained by gradients: they follow an exponential moving average of the
vectors assigned to them (Eq 8-10). That state is explicit: :func:`routing_attention` takes a
:class:`RoutingState` and returns the updated one, with the commitment loss that pulls the
routed vectors towards their centroids.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from ... import kernels
from ._sorted_chunks import (
    chunk_attention, pack_bits, permute, shared_count, sort_by_code,
)


class RoutingState(NamedTuple):
    """The EMA k-means state of one head: ``sums f32[K, D]`` (Eq 8) and ``counts f32[K]`` (Eq 9).

    The centroids are ``sums / counts`` (Eq 10), used after l2 normalisation (spherical).
    """

    sums: jax.Array
    counts: jax.Array


class RoutingAux(NamedTuple):
    """What :func:`routing_attention` returns besides its output."""

    state: RoutingState  # the state after this step's EMA update (no gradient flows into it)
    commitment_loss: jax.Array  # mean ||x/|x| - centroid(x)||^2 over the routed q and k


def init_routing_state(key, num_clusters: int, dim: int) -> RoutingState:
    """Random unit centroids with unit counts: ``RoutingState(f32[K, dim], f32[K])``."""
    name = "init_routing_state"
    num_clusters = C.check_positive_int(name, "num_clusters", num_clusters)
    dim = C.check_positive_int(name, "dim", dim)
    c = jax.random.normal(key, (num_clusters, dim), jnp.float32)
    return RoutingState(_unit(c), jnp.ones((num_clusters,), jnp.float32))


def _unit(x):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, -1, keepdims=True), 1e-12))


def centroids(state: RoutingState):
    """The unit centroids ``f32[K, D]`` of a state (Eq 10, then l2-normalised)."""
    return _unit(state.sums / jnp.maximum(state.counts, 1e-12)[:, None])


def kmeans_update(state: RoutingState, q_unit, k_unit, q_real, k_real, decay: float):
    """One EMA step (Eq 8-10): each real unit query and key joins its nearest centroid.

    Returns the new state and the commitment loss (gradients reach q and k only).
    """
    mu = jax.lax.stop_gradient(centroids(state))
    num_clusters = mu.shape[0]
    sums, counts, loss, n = 0.0, 0.0, 0.0, 0.0
    for x, real in ((q_unit, q_real), (k_unit, k_real)):
        assign = jnp.argmax(jax.lax.stop_gradient(x) @ mu.T, axis=-1)
        onehot = jax.nn.one_hot(assign, num_clusters, dtype=jnp.float32) * real[:, None]
        sums = sums + onehot.T @ jax.lax.stop_gradient(x)
        counts = counts + onehot.sum(0)
        loss = loss + jnp.sum(real * jnp.sum((x - mu[assign]) ** 2, -1))
        n = n + real.sum()
    new = RoutingState(
        decay * state.sums + (1.0 - decay) * sums,
        decay * state.counts + (1.0 - decay) * counts,
    )
    return new, loss / jnp.maximum(n, 1.0)


def routing_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    state: RoutingState,
    *,
    window: int,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    q_mask: Bool[Array, "q_seq"] | None = None,
    scale: float | None = None,
    decay: float = 0.999,
    key=None,
):
    """Routing attention for one sequence and one head; returns ``(out, RoutingAux)``.

    Queries and keys are l2-normalised and routed to the K centroids of ``state``.

    - ``causal=False`` (the paper's balanced routing): each cluster takes its ``window``
      nearest queries and its ``window`` nearest keys (top-k by cosine), and its queries attend
      to its keys. A query chosen by several clusters gets the softmax over the union of their
      keys (partial results merged by log-sum-exp, each score corrected by ``-log`` of the
      number of clusters that pair shares); a query no cluster chose gets zeros.
    - ``causal=True``: a top-k over the whole sequence lets a later token push an earlier one
      out of a cluster, which leaks the future. Instead each position is routed once, by
      ``q/|q| + k/|k|`` (T1 Eq 1 with ``W_R = I``; project beforehand for a learned ``W_R``),
      and query i attends to the last ``window`` positions j <= i of its cluster, found by
      sorting on (cluster, position). Nothing it sees depends on later tokens.

    Decoding: centroids are frozen at inference; a new token is routed to its nearest centroid
    and attends to the cached tokens of that cluster (the last ``window`` of them), which is
    exactly the causal rule above, so training and decoding agree.

    The state update (Eq 8-10) and the commitment loss use the real queries (``q_mask``) and
    keys (``kv_mask``) only, and a cluster's ``window`` queries and keys are chosen among the
    real ones, so padding moves no centroid and takes no slot. Under :func:`multihead` the
    returned state has leading ``[batch, heads]`` axes: average over the batch (the update is
    linear in the batch statistics) to get the next state.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      state: :class:`RoutingState` with ``sums [K, Dk]``, from :func:`init_routing_state`.
      window: queries/keys per cluster (non-causal) or keys per query (causal).
      causal: query i sees keys j <= i only (needs ``Lq == Lk``).
      kv_mask: ``bool[Lk]``, True for real keys.
      q_mask: ``bool[Lq]``, True for real queries (default: ``kv_mask`` when ``Lq == Lk``);
        masked queries' outputs are zeros.
      scale: score scale, ``1/sqrt(Dk)`` by default.
      decay: the EMA factor lambda of Eq 8-9.

    Returns:
      ``(out [Lq, Dv] in q's dtype, RoutingAux(state, commitment_loss))``.
    """
    name = "routing_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    window = C.check_positive_int(name, "window", window)
    scale = C.resolve_scale(x.dk, scale)
    if not 0.0 <= float(decay) <= 1.0:
        raise ValueError(f"{name}: decay must be in [0, 1] but got {decay}")
    sums, counts = (jnp.asarray(a) for a in state)
    if sums.ndim != 2 or sums.shape[1] != x.dk or counts.shape != (sums.shape[0],):
        raise ValueError(
            f"{name}: state must hold sums (K, Dk={x.dk}) and counts (K,) but got "
            f"{tuple(sums.shape)} and {tuple(counts.shape)}"
        )
    state = RoutingState(sums, counts)
    q_mask = C.check_q_mask(name, q_mask, kv_mask, x.lq, x.lk)
    k_real = jnp.ones((x.lk,), bool) if kv_mask is None else kv_mask
    q_real = jnp.ones((x.lq,), bool) if q_mask is None else q_mask
    q_unit, k_unit = _unit(x.q), _unit(x.k)
    new_state, loss = kmeans_update(state, q_unit, k_unit, q_real, k_real, decay)
    mu = jax.lax.stop_gradient(centroids(state))
    if causal:
        C.check_same_length(name, x, "causal routing needs Lq == Lk")
        out = _causal(x, mu, q_unit + k_unit, k_real, window, scale)
    else:
        if window > min(x.lq, x.lk):
            raise ValueError(
                f"{name}: window={window} exceeds the sequence lengths q{tuple(x.q.shape)}, "
                f"k{tuple(x.k.shape)}"
            )
        out = _balanced(x, mu, q_unit, k_unit, q_real, k_real, window, scale)
    return C.zero_masked_rows(out.astype(x.q.dtype), q_mask), RoutingAux(new_state, loss)


def _balanced(x, mu, q_unit, k_unit, q_real, k_real, window, scale):
    sim_q = jnp.where(q_real[None], mu @ jax.lax.stop_gradient(q_unit).T, -jnp.inf)
    sim_k = jnp.where(k_real[None], mu @ jax.lax.stop_gradient(k_unit).T, -jnp.inf)
    idx_q = jax.lax.top_k(sim_q, window)[1]  # [K, w]
    idx_k = jax.lax.top_k(sim_k, window)[1]
    num_clusters = mu.shape[0]
    in_q = jnp.zeros((num_clusters, x.lq), bool).at[jnp.arange(num_clusters)[:, None], idx_q].set(True)
    in_k = jnp.zeros((num_clusters, x.lk), bool).at[jnp.arange(num_clusters)[:, None], idx_k].set(True)
    bits_q, bits_k = pack_bits(in_q), pack_bits(in_k)

    s = jnp.einsum(
        "cqd,ckd->cqk", x.q[idx_q], x.k[idx_k], preferred_element_type=C.STATS_DTYPE
    ) * scale
    shared = shared_count(bits_q[idx_q][:, :, None, :], bits_k[idx_k][:, None, :, :])
    s = s - jnp.log(jnp.maximum(shared, 1).astype(jnp.float32))
    s = jnp.where(k_real[idx_k][:, None, :], s, -jnp.inf)
    m = jax.lax.stop_gradient(kernels.safe_max(s.max(-1)))
    p = jnp.exp(s - m[..., None])
    l = p.sum(-1)
    part = kernels.normalise(
        jnp.einsum("cqk,ckd->cqd", p.astype(x.v.dtype), x.v[idx_k],
                   preferred_element_type=C.STATS_DTYPE), l)
    lse = kernels.log_sum_exp(m, l)

    # Merge each query's occurrences (one per cluster that chose it) by their log-sum-exp.
    flat_q, flat_lse = idx_q.reshape(-1), lse.reshape(-1)
    top = jnp.full((x.lq,), -jnp.inf, jnp.float32).at[flat_q].max(flat_lse)
    top = jax.lax.stop_gradient(kernels.safe_max(top))
    w = jnp.exp(flat_lse - top[flat_q])
    num = jnp.zeros((x.lq, x.dv), jnp.float32).at[flat_q].add(w[:, None] * part.reshape(-1, x.dv))
    den = jnp.zeros((x.lq,), jnp.float32).at[flat_q].add(w)
    return kernels.normalise(num, den)


def _causal(x, mu, route, real, window, scale):
    length = x.lq
    padded = -(-length // window) * window
    num_clusters = mu.shape[0]

    def pad(a, value=0):
        return jnp.pad(a, [(0, padded - length)] + [(0, 0)] * (a.ndim - 1), constant_values=value)

    valid = pad(real, False)
    cluster = jnp.argmax(jax.lax.stop_gradient(route) @ mu.T, axis=-1).astype(jnp.int32)
    cluster = jnp.where(valid, pad(cluster), num_clusters)  # padding gets its own cluster
    positions = jnp.arange(padded, dtype=jnp.int32)
    perm, inverse = sort_by_code(cluster * padded + positions)
    prev = jnp.concatenate([jnp.full((window,), -1, jnp.int32), perm[:-window]])
    pos_q = perm.reshape(-1, window, 1)
    pos_k = jnp.concatenate([prev.reshape(-1, window), perm.reshape(-1, window)], 1)[:, None, :]
    safe_k = jnp.maximum(pos_k, 0)

    def score_fn(s):
        sq, sk = inverse[pos_q], inverse[safe_k]
        allowed = (pos_k >= 0) & valid[safe_k] & (cluster[pos_q] == cluster[safe_k])
        allowed &= (safe_k <= pos_q) & (sq - sk < window)
        return jnp.where(allowed, s, -jnp.inf)

    out_s, _ = chunk_attention(
        permute(pad(x.q), perm, inverse), permute(pad(x.k), perm, inverse),
        permute(pad(x.v), perm, inverse), score_fn, chunk=window, scale=scale,
    )
    return permute(out_s, inverse, perm)[:length]
