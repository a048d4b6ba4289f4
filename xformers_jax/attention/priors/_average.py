"""The average attention network (Zhang et al., 2018, "Accelerating Neural Transformer via an
Average Attention Network").

Attention with a uniform prior and nothing else: position ``i`` takes the cumulative average of
the values ``g_i = (1/i) sum_{j <= i} v_j`` and a gate mixes it with its own input,
``[i_t; f_t] = sigmoid([x_i; g_i] W + b)``, ``h_i = i_t * x_i + f_t * g_i`` (the paper's eqs.
1-3). Training is parallel (a cumulative sum); decoding keeps the running sum and count, so a
step costs the same at every position.

Adapted to the one-head contract: the gate sees the block input through the head's query
``q_i`` (its projection of ``x_i``) and mixes the head's own value ``v_i`` with the average,
``[i_t; f_t] = sigmoid([q_i; g_i] W + b)``, ``h_i = i_t * v_i + f_t * g_i`` with
``W [Dk + Dv, 2 Dv]``; the paper's feed-forward layer before the gate is the block's own FFN.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._flex import document_sum


class AverageGate(NamedTuple):
    """The gate of one head: ``w [Dk + Dv, 2 Dv]``, ``b [2 Dv]`` (input ``[q; g]``, output
    ``[input gate; forget gate]``)."""

    w: jax.Array
    b: jax.Array


def init_average_gate(key, dk: int, dv: int, dtype=jnp.float32) -> AverageGate:
    """A gate for queries of width ``dk`` and values of width ``dv`` (scaled normal weights,
    zero bias)."""
    return AverageGate(jax.random.normal(key, (dk + dv, 2 * dv), dtype) * (dk + dv) ** -0.5,
                       jnp.zeros((2 * dv,), dtype))


def _gated(q, x, g, gate):
    if gate is None:
        return g
    dk, dv = q.shape[-1], x.shape[-1]
    if gate.w.shape != (dk + dv, 2 * dv) or gate.b.shape != (2 * dv,):
        raise ValueError(f"average_attention: the gate must be w [Dk + Dv, 2 Dv] = [{dk + dv}, "
                         f"{2 * dv}], b [{2 * dv}] for q of width {dk} and v of width {dv}; got "
                         f"w{tuple(gate.w.shape)}, b{tuple(gate.b.shape)}")
    z = jnp.concatenate([q.astype(jnp.float32), g], axis=-1) @ gate.w.astype(jnp.float32) \
        + gate.b.astype(jnp.float32)
    i_gate, f_gate = jnp.split(jax.nn.sigmoid(z), 2, axis=-1)
    return i_gate * x + f_gate * g


def average_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    gate: AverageGate | None = None,
    *,
    causal=False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale=None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Average attention over one sequence and one head.

    Args:
      q: ``[L, Dk]``: the gate's view of the input. k: ``[L, Dk]``: only checked (the
        weights are uniform).
      v: ``[L, Dv]``.
      gate: an :class:`AverageGate`, or None for the plain average ``g`` (then ``q`` is
        unused).
      causal: ``g_i`` averages ``v_j, j <= i`` (the decoder's form, the paper's); otherwise
        every position averages all real values.
      kv_mask: ``bool[L]``; padded values are left out of the averages (a position with no
        real value before it gets ``g = 0``).
      segment_ids: packed-sequence ids ``int[L]``: the averages are each document's own (the
        sums and counts restart at every document).

    Returns:
      ``[L, Dv]`` in ``v``'s dtype (accumulated in float32).
    """
    name = "average_attention"
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    C.check_same_length(name, x, "needs self-attention (Lq == Lk): the gate mixes each "
                        "position's own value with its average")
    vf = x.v.astype(jnp.float32)
    m = jnp.ones((x.lk,), jnp.float32) if kv_mask is None else kv_mask.astype(jnp.float32)
    # A select, not a product: padded values may hold anything, NaN included.
    mv = jnp.where(m[:, None] > 0, vf, 0.0)
    if isinstance(segment_ids, (tuple, list)):
        raise ValueError(f"{name}: segment_ids must be one int[L] array (self-attention), got "
                         "a (q, kv) pair")
    C.check_segment_ids(name, segment_ids, x.lq, x.lk)
    if segment_ids is not None:
        total, count = document_sum(segment_ids, mv), document_sum(segment_ids, m)[:, None]
        if not causal:  # the whole document: the sums up to and from each position
            total = total + document_sum(segment_ids, mv, reverse=True) - mv
            count = count + document_sum(segment_ids, m, reverse=True)[:, None] - m[:, None]
    elif causal:
        total, count = jnp.cumsum(mv, axis=0), jnp.cumsum(m)[:, None]
    else:
        total, count = jnp.sum(mv, axis=0, keepdims=True), jnp.sum(m)[None, None]
    g = jnp.broadcast_to(total / jnp.maximum(count, 1.0), vf.shape)
    return _gated(x.q, vf, g, gate).astype(x.v.dtype)


class AverageState(NamedTuple):
    """Decoding state of one head: the running sum ``[Dv]`` and count (float32)."""

    total: jax.Array
    count: jax.Array


def average_attention_init_state(dv: int) -> AverageState:
    return AverageState(jnp.zeros((dv,), jnp.float32), jnp.zeros((), jnp.float32))


def average_attention_step(state: AverageState, q, k, v, gate: AverageGate | None = None):
    """One causal decoding step (O(1) in the position): ``q, k [Dk]``, ``v [Dv]`` ->
    ``(out [Dv], state)``, equal to row ``t`` of ``average_attention(..., causal=True)``."""
    x = C.check_token("average_attention_step", q, k, v)
    vf = x.v[0].astype(jnp.float32)
    state = AverageState(state.total + vf, state.count + 1.0)
    g = state.total / state.count
    return _gated(x.q[0], vf, g, gate).astype(x.v.dtype), state
