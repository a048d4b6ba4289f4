"""Sequence-parallel linear attention: prefix states passed between shards (causal), one
summed state (non-causal).

The causal recurrence ``S_t = exp(ld_t) S_{t-1} + phi(k_t) [v_t, 1]^T``, ``out_t = phi(q_t) S_t``
(Katharopoulos et al., 2020; gated as in Peng et al., 2021; see ``attention.linear._scan``) is
associative over shards: shard r summarises its keys as the state it would reach from zero,
``S_r``, and its total log-decay ``T_r``. Each shard gathers the n summaries
(``lax.all_gather``: n small ``[M, Dv+1]`` matrices), forms the exclusive prefix
``S_in(r) = sum_{r'<r} exp(T_{r'+1} + ... + T_{r-1}) S_{r'}``, and adds
``phi(q_t) exp(ld_1 + ... + ld_t) S_in(r)`` to its local causal outputs. Features, gates and
the chunked scan are ``linear_attention``'s own. Without ``causal`` every shard needs the sum
of all keys' states, ``sum_r S_r``: one ``lax.psum``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from ... import axes as X
from .. import _contract as C
from ._linear import _guard, _prepare, check_implementation, linear_attention
from ._scan import causal_chunked

_NAME = "sequence_parallel_linear_attention"


def _local(axis, n, chunk_size, eps, positive, dv, fq, fk, v_aug, ld):
    out = causal_chunked(fq, fk, v_aug, ld, chunk_size)
    cum = jnp.cumsum(ld)
    # This shard's state from zero: each key decayed by the log-decays after it.
    summary = jnp.einsum("lm,le->me", fk * jnp.exp(cum[-1] - cum)[:, None], v_aug)
    summaries = lax.all_gather(summary, axis)  # [n, M, E]
    totals = lax.all_gather(cum[-1], axis)  # [n]
    r = lax.axis_index(axis)
    inclusive = jnp.cumsum(totals)
    # Shard r' < r reaches shard r decayed by T_{r'+1} + ... + T_{r-1} = inc[r-1] - inc[r'].
    before = jnp.arange(n) < r
    log_w = jnp.where(before, inclusive[jnp.maximum(r - 1, 0)] - inclusive, -jnp.inf)
    s_in = jnp.einsum("r,rme->me", jnp.exp(log_w), summaries)
    out = out + (fq * jnp.exp(cum)[:, None]) @ s_in
    return out[:, :dv] / _guard(out[:, dv], positive, eps)[:, None]


def _global(axis, eps, positive, dv, fq, fk, v_aug):
    out = fq @ lax.psum(fk.T @ v_aug, axis)
    return out[:, :dv] / _guard(out[:, dv], positive, eps)[:, None]


def sequence_parallel_linear_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *feature_arrays,
    feature_map="elu",
    causal: bool = True,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    gate_logits=None,
    log_decay=None,
    chunk_size: int = 64,
    eps: float = 1e-6,
    mesh=None,
    axis_name: str = X.SEQUENCE,
) -> Float[Array, "q_seq v_dim"]:
    """:func:`~xformers_jax.attention.linear_attention` with the sequence sharded.

    Equal to ``linear_attention(...)`` with the same arguments (gradients by autodiff through
    ``shard_map``). Communication is one all-gather of n states ``[M, Dv+1]`` per call
    (causal) or one all-reduce of a state (non-causal), independent of the length. Without a
    mesh (or an axis of size 1) it is ``linear_attention``. Lengths not divisible by the axis
    size are padded with masked keys.

    ``q, k, v, *feature_arrays`` and ``feature_map``, ``causal``, ``kv_mask``, ``scale``,
    ``gate_logits``, ``log_decay``, ``chunk_size``, ``eps`` are as in ``linear_attention``;
    ``causal`` defaults to True here (the prefix-state passing this function exists for).
    Non-causal needs ``Lq == Lk`` too (queries and keys are split alike).

    Args:
      mesh: default the mesh active in :func:`use_mesh`.
      axis_name: the mesh axis the sequence is split over.

    Returns:
      ``[L, Dv]`` in q's dtype.

    Raises:
      NotImplementedError: causal with a log-space feature map (FAVOR+ positive, hyperbolic),
        whose key stabiliser is a running maximum over the whole prefix.
    """
    check_implementation(_NAME, "chunked", chunk_size)
    mesh, n = X.mesh_for(axis_name, mesh)
    kwargs = dict(feature_map=feature_map, kv_mask=kv_mask, scale=scale, gate_logits=gate_logits,
                  log_decay=log_decay, chunk_size=chunk_size, eps=eps)
    if n == 1:
        return linear_attention(q, k, v, *feature_arrays, causal=causal, **kwargs)
    x, fm, fq, fk, v_aug, ld = _prepare(
        _NAME, q, k, v, feature_arrays, feature_map, causal, kv_mask, scale, gate_logits,
        log_decay
    )
    if not causal:
        C.check_same_length(_NAME, x, "the sequence-parallel form splits queries and keys alike")
    if causal and fm.log_space:
        raise NotImplementedError(
            f"{_NAME}: log-space feature maps stabilise keys by a running maximum over the "
            "whole prefix, which the per-shard summaries do not carry; use a non-exponential "
            "map (elu, relu, dpfp, favor_trig, rfa) or run without sequence parallelism"
        )
    length = -(-x.lq // n) * n
    # Padded positions add nothing (zero features and values) and do not decay (ld = 0).
    fq, fk, v_aug, ld = (jnp.pad(a, [(0, length - x.lq)] + [(0, 0)] * (a.ndim - 1))
                         for a in (fq, fk, v_aug, ld))
    spec = P(axis_name)
    if causal:
        fn, args = functools.partial(_local, axis_name, n, chunk_size, eps, fm.positive,
                                     x.dv), (fq, fk, v_aug, ld)
    else:
        fn, args = functools.partial(_global, axis_name, eps, fm.positive, x.dv), (fq, fk, v_aug)
    # jit: a shard_map over some of the mesh axes cannot run eagerly.
    out = jax.jit(jax.shard_map(
        fn, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec,
        axis_names=frozenset({axis_name}), check_vma=False,
    ))(*args)
    return out[: x.lq].astype(x.q.dtype)
