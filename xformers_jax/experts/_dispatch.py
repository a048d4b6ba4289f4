"""Expert MLPs and the two dispatch modes of token-choice routing, plus expert choice.

Experts are MLPs ``act(x W1[e]) W2[e]`` (gated: ``act(x W1[e]) * (x Wg[e])``; Shazeer, 2020)
with weights stacked on a leading expert axis (:class:`ExpertWeights`).

**Capacity dispatch** (Lepikhin et al., 2020, GShard; Fedus et al., 2021, Switch): each expert
has a buffer of ``C = ceil(capacity_factor * T * k / E)`` slots, ``T`` the number of REAL
tokens (so the padded amount changes nothing; the static buffer is sized with all ``T``).
Assignments claim slots in priority order and those past ``C`` are dropped (their share goes
through the residual: the layer adds 0 for them, gates are not renormalised):

* ``priority="choice"`` (default, GShard/Switch): every token's first choice before any
  token's second choice, tokens in order within a choice. A token's second choice then depends
  on LATER tokens' first choices, so this is not causal-safe for k > 1.
* ``priority="token"``: token by token in order, each token's choices in slot order; a token's
  fate depends only on earlier tokens (causal-safe; with k = 1 both orders agree).

Padded tokens and slots with gate 0 (GShard's randomly skipped second choice) claim no slot.

Which tokens share a capacity (``group``):

* ``"batch"`` (GShard, Switch): all ``T = B * L`` tokens of the call are one group, in
  row-major order, with the capacity above. A token's fate depends on the other rows and
  (through ``C``, and through ``priority="choice"``) on later tokens: NOT causal-safe, and a
  prefix or a decoding step routes differently from the full sequence.
* ``"sequence"``: each row is its own group, admitted token by token under a RUNNING capacity:
  expert ``e`` takes the ``t``-th token of a row iff fewer than
  ``u_t = ceil(capacity_factor * n_t * k / E)`` of the row's earlier tokens went to ``e``,
  ``n_t`` the number of real tokens up to and including ``t``. A token's fate depends only on
  its own row's earlier tokens, so training, scoring a prefix and decoding agree; a decoder
  carries the per-row per-expert counts (:class:`CapacityState`). Since ``u_t`` is
  non-decreasing and a count grows by at most one per token, the count before token ``t`` obeys
  ``c_{t+1} = min(c_t + w_t, u_t)`` (``w_t``: the token asks for ``e``), whose closed form
  ``c_t = W_t + min(c_0, min_{s<t} (u_s - W_{s+1}))`` (``W_t`` the requests before ``t``) is a
  cumulative sum and a cumulative minimum: no sequential scan. A token's ``k`` choices are
  distinct experts (every token-choice router gives distinct ones), so ``priority`` has no
  role. At the full length ``u`` is ``ceil(capacity_factor * L * k / E)`` per row, the buffer
  (``B`` times that per expert) is the size of a batch group's.

**Dropless dispatch** (Gale et al., 2022, "MegaBlocks"): the ``T * k`` assignments are sorted by
expert and every expert's rows go through one grouped matmul (:mod:`._grouped`, XLA's
``ragged_dot`` by default); no capacity, nothing dropped, causal-safe.

Both equal :func:`moe_reference`, which runs each token through its chosen experts with its
gates (and, for capacity dispatch, the ``kept`` mask).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ._grouped import (TILE, block_layout, block_mlp, default_backend, grouped_matmul,
                       mlp_parts)
from ._routers import ExpertChoice, Routing

ACTIVATIONS = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "swish": jax.nn.swish}
PRIORITIES = ("choice", "token")
MODES = ("capacity", "dropless")
CAPACITY_GROUPS = ("batch", "sequence")


class CapacityState(NamedTuple):
    """The decoding state of ``"sequence"`` capacity: per row, the assignments each expert has
    taken (``counts int32[B, E]``) and the real tokens seen (``seen int32[B]``)."""

    counts: jax.Array
    seen: jax.Array

    @classmethod
    def empty(cls, batch: int, num_experts: int) -> "CapacityState":
        return cls(jnp.zeros((batch, num_experts), jnp.int32), jnp.zeros((batch,), jnp.int32))


class ExpertWeights(NamedTuple):
    """``w1 [E, d, h]``, ``w2 [E, h, d]``, optional ``w_gate [E, d, h]`` (gated MLP)."""

    w1: jax.Array
    w2: jax.Array
    w_gate: jax.Array | None = None


def init_expert_weights(key, num_experts: int, dim: int, hidden: int, *, gated: bool = False,
                        dtype=jnp.float32) -> ExpertWeights:
    k1, k2, k3 = jax.random.split(key, 3)
    w1 = jax.random.normal(k1, (num_experts, dim, hidden), dtype) / math.sqrt(dim)
    w2 = jax.random.normal(k2, (num_experts, hidden, dim), dtype) / math.sqrt(hidden)
    wg = jax.random.normal(k3, (num_experts, dim, hidden), dtype) / math.sqrt(dim) if gated \
        else None
    return ExpertWeights(w1, w2, wg)


def _check(x, weights: ExpertWeights, activation: str):
    if x.ndim != 2:
        raise ValueError(f"MoE dispatch: x must be [tokens, dim], got {x.shape}")
    if weights.w1.ndim != 3 or weights.w1.shape[1] != x.shape[1]:
        raise ValueError(f"MoE dispatch: w1 must be [experts, {x.shape[1]}, hidden], got "
                         f"{weights.w1.shape}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"MoE dispatch: activation must be one of {tuple(ACTIVATIONS)}, got "
                         f"{activation!r}")


def _mlp(x, w1, w2, wg, activation, matmul):
    return mlp_parts(x, w1, w2, wg, ACTIVATIONS[activation], matmul)[2]


def moe_reference(x, routing: Routing, weights: ExpertWeights, *, activation: str = "gelu",
                  kept=None):
    """Per token: ``y_t = sum_j gates[t, j] * kept[t, j] * MLP_{experts[t, j]}(x_t)``.
    ``x [T, d]`` -> ``[T, d]`` (the specification; gathers every chosen expert's weights)."""
    _check(x, weights, activation)
    gates = routing.gates if kept is None else routing.gates * kept

    def one(xt, es, gs):
        def slot(e, g):
            wg = None if weights.w_gate is None else weights.w_gate[e].astype(xt.dtype)
            y = _mlp(xt[None], weights.w1[e].astype(xt.dtype), weights.w2[e].astype(xt.dtype),
                     wg, activation, jnp.matmul)[0]
            return g.astype(xt.dtype) * y
        return jax.vmap(slot)(es, gs).sum(0)

    return jax.vmap(one)(x, routing.experts, gates)


def capacity(num_tokens, num_experts: int, k: int, capacity_factor: float):
    """``C = ceil(capacity_factor * num_tokens * k / num_experts)`` (an int for an int
    ``num_tokens``, an int32 array for a traced count)."""
    if isinstance(num_tokens, int):
        return max(1, math.ceil(capacity_factor * num_tokens * k / num_experts))
    c = jnp.ceil(capacity_factor * num_tokens.astype(jnp.float32) * k / num_experts)
    return jnp.maximum(c, 1).astype(jnp.int32)


def capacity_slots(routing: Routing, num_experts: int, capacity_factor: float, *,
                   priority: str = "choice", mask=None):
    """Slot of every assignment in its expert's buffer and whether it is kept:
    ``(position int32[T, k], kept bool[T, k], C_static)`` (see the module docstring)."""
    if priority not in PRIORITIES:
        raise ValueError(f"capacity dispatch: priority must be one of {PRIORITIES}, got "
                         f"{priority!r}")
    t, k = routing.experts.shape
    active = routing.gates != 0
    if mask is not None:
        active = active & mask[:, None]
    c_static = capacity(t, num_experts, k, capacity_factor)
    c_dyn = c_static if mask is None else capacity(mask.sum(), num_experts, k, capacity_factor)
    ex, act = routing.experts, active
    if priority == "choice":  # slot-major order
        ex, act = ex.T, act.T
    onehot = jax.nn.one_hot(ex.reshape(-1), num_experts, dtype=jnp.int32) * act.reshape(-1, 1)
    pos = (jnp.cumsum(onehot, axis=0) - 1) * onehot
    pos = pos.sum(-1).reshape(ex.shape)
    if priority == "choice":
        pos = pos.T
    kept = active & (pos < c_dyn)
    return pos.astype(jnp.int32), kept, c_static


def sequence_capacity_slots(routing: Routing, num_experts: int, capacity_factor: float, *,
                            length: int, mask=None, state: CapacityState | None = None):
    """``"sequence"`` capacity (see the module docstring): the ``T = B * length`` tokens are
    ``B`` rows of ``length`` in row-major order, each admitted under its own running capacity,
    starting from ``state`` (the counts a decoder carried; None: a fresh row). Returns
    ``(position int32[T, k], kept bool[T, k], C_static, new_state)``: ``position`` is the slot
    in the expert's buffer of ``C_static = B * min(length, ceil(capacity_factor * length * k /
    E))`` slots
    (row ``b`` owns slots ``[b * C_row, (b + 1) * C_row)``; ``C_row = length`` when a state is
    given)."""
    t, k = routing.experts.shape
    e = num_experts
    if length < 1 or t % length:
        raise ValueError(f"sequence capacity: {t} tokens are not rows of length {length}")
    b = t // length
    real = jnp.ones((t,), bool) if mask is None else mask
    active = (routing.gates != 0) & real[:, None]
    state_given = state is not None
    if not state_given:
        state = CapacityState.empty(b, e)
    # w[b, t, e]: the token asks expert e (its k choices are distinct experts).
    want = (jax.nn.one_hot(routing.experts, e, dtype=jnp.int32)
            * active[..., None]).sum(1).reshape(b, length, e)
    seen = state.seen[:, None] + jnp.cumsum(real.reshape(b, length), axis=1, dtype=jnp.int32)
    cap = jnp.ceil(capacity_factor * seen.astype(jnp.float32) * k / e).astype(jnp.int32)
    w_incl = jnp.cumsum(want, axis=1)  # W_{t+1}
    floor = jax.lax.cummin(cap[..., None] - w_incl, axis=1)  # min_{s<=t} (u_s - W_{s+1})
    floor = jnp.minimum(state.counts[:, None], floor)
    prev = jnp.concatenate([state.counts[:, None], (w_incl + floor)[:, :-1]], axis=1)  # c_t
    take = (want > 0) & (prev < cap[..., None])  # [b, L, e]
    rank = prev - state.counts[:, None]  # slot among this call's assignments of the row
    # A row gives an expert at most one assignment per token, and from a fresh state at most
    # u at the full length; a carried state may have unused capacity, so only the length bounds.
    c_row = length if state_given else min(length, capacity(length, e, k, capacity_factor))
    flat = lambda a: a.reshape(t, e)  # noqa: E731
    kept = active & jnp.take_along_axis(flat(take), routing.experts, axis=1)
    pos = jnp.take_along_axis(flat(rank), routing.experts, axis=1)
    pos = pos + (jnp.arange(t) // length * c_row)[:, None]
    new = CapacityState(w_incl[:, -1] + floor[:, -1], seen[:, -1])
    return pos.astype(jnp.int32), kept, b * c_row, new


def moe_capacity(x, routing: Routing, weights: ExpertWeights, *, capacity_factor: float = 1.25,
                 priority: str = "choice", activation: str = "gelu", mask=None,
                 group: str = "batch", length: int | None = None,
                 state: CapacityState | None = None):
    """Capacity dispatch: ``x [T, d]`` -> ``(y [T, d], kept bool[T, k])``; with
    ``group="sequence"`` (rows of ``length``, see :func:`sequence_capacity_slots`) ``(y, kept,
    new_state)``."""
    _check(x, weights, activation)
    e = weights.w1.shape[0]
    if group == "sequence":
        pos, kept, c, new = sequence_capacity_slots(routing, e, capacity_factor, length=length,
                                                    mask=mask, state=state)
        return (*_capacity_combine(x, routing, weights, pos, kept, c, activation), new)
    if group != "batch":
        raise ValueError(f"capacity dispatch: group must be one of {CAPACITY_GROUPS}, got "
                         f"{group!r}")
    pos, kept, c = capacity_slots(routing, e, capacity_factor, priority=priority, mask=mask)
    return _capacity_combine(x, routing, weights, pos, kept, c, activation)


def _capacity_combine(x, routing, weights, pos, kept, c, activation):
    """The ``[E, c, d]`` buffers filled at ``pos``, the experts run, the outputs gathered back
    with their gates (dropped assignments add 0): ``(y [T, d], kept)``."""
    d = x.shape[1]
    e = weights.w1.shape[0]
    slot = jnp.where(kept, routing.experts * c + pos, e * c)  # trash row e * c
    buf = jnp.zeros((e * c + 1, d), x.dtype).at[slot.reshape(-1)].add(
        jnp.repeat(x, routing.experts.shape[1], axis=0))
    buf = buf[:-1].reshape(e, c, d)
    batched = lambda a, w: jnp.einsum("ecd,edh->ech", a, w.astype(a.dtype))  # noqa: E731
    out = _mlp(buf, weights.w1, weights.w2, weights.w_gate, activation, batched)
    out = jnp.concatenate([out.reshape(e * c, d), jnp.zeros((1, d), out.dtype)])
    gates = (routing.gates * kept).astype(x.dtype)
    y = (out[slot] * gates[..., None]).sum(1)
    return y, kept


@jax.custom_vjp
def _take_rows(a, idx, inv):
    """``a [n, d]`` -> ``[m, d]``, row ``r`` being ``a[idx[r]]`` (``idx[r] == n``: zeros).
    ``idx`` must be one-to-one on the rows it takes and ``inv`` its inverse (``inv[i] = r``
    where ``idx[r] == i``, ``m`` where none), so the transpose is the gather ``g[inv]``
    instead of a scatter-add (scatters are slow on XLA:CPU)."""
    return jnp.concatenate([a, jnp.zeros((1, a.shape[1]), a.dtype)])[idx]


def _take_rows_fwd(a, idx, inv):
    return _take_rows(a, idx, inv), (idx, inv)


def _take_rows_bwd(res, g):
    idx, inv = res
    return jnp.concatenate([g, jnp.zeros((1, g.shape[1]), g.dtype)])[inv], None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def _dropless_tiled(x, routing: Routing, weights: ExpertWeights, active, activation, tile):
    """Dropless dispatch in MegaBlocks' padded block layout, end to end: each active
    assignment gets a row of a buffer where every expert's rows start on a ``tile`` boundary;
    the whole expert MLP runs there, both matmuls per run of blocks by its expert's weights
    (:func:`~._grouped.block_mlp`: the hidden activations never leave the run's blocks, each
    weight gradient is accumulated per expert); the outputs come back by one gather per
    assignment. Every row move is a gather whose transpose is the inverse
    gather (:func:`_take_rows`), so forward and backward have no scatter of activations."""
    t, d = x.shape
    e = weights.w1.shape[0]
    k = routing.experts.shape[1]
    n = t * k
    key = jnp.where(active, routing.experts, e).reshape(-1)  # inactive assignments: "expert" e
    sizes = jnp.bincount(key, length=e + 1)[:e].astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    pstarts, tile_group, n_used, n_tiles = block_layout(sizes, n, tile)
    rows = n_tiles * tile
    order = jnp.argsort(key, stable=True)
    rank = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    kc = jnp.minimum(key, e - 1)
    dest = jnp.where(key < e, pstarts[kc] + rank - starts[kc], rows)  # buffer row per assignment
    src = jnp.full((rows,), n, jnp.int32).at[dest].set(jnp.arange(n, dtype=jnp.int32),
                                                       mode="drop")
    buf = _take_rows(jnp.repeat(x, k, axis=0), src, dest)
    cast = lambda w: None if w is None else w.astype(buf.dtype)  # noqa: E731
    out = block_mlp(buf, cast(weights.w1), cast(weights.w2), cast(weights.w_gate), tile_group,
                    n_used, ACTIVATIONS[activation], tile)
    y = _take_rows(out, dest, src).reshape(t, k, d)
    return (y * (routing.gates * active).astype(x.dtype)[..., None]).sum(1)


def moe_dropless(x, routing: Routing, weights: ExpertWeights, *, activation: str = "gelu",
                 backend: str | None = None, mask=None):
    """Dropless dispatch through one grouped matmul: ``x [T, d]`` -> ``y [T, d]``. With the
    ``"tiled"`` backend (the CPU default) the whole MLP runs in the padded block layout
    (:func:`_dropless_tiled`); other backends sort the assignments and call
    :func:`~._grouped.grouped_matmul` per weight."""
    _check(x, weights, activation)
    t, d = x.shape
    e = weights.w1.shape[0]
    k = routing.experts.shape[1]
    active = routing.gates != 0
    if mask is not None:
        active = active & mask[:, None]
    if (backend or default_backend()) == "tiled":
        return _dropless_tiled(x, routing, weights, active, activation, TILE)
    key = jnp.where(active, routing.experts, e).reshape(-1)  # inactive rows sort last
    order = jnp.argsort(key, stable=True)
    tokens = jnp.repeat(jnp.arange(t), k)[order]
    sizes = jnp.bincount(key, length=e + 1)[:e].astype(jnp.int32)
    gm = lambda a, w: grouped_matmul(a, w.astype(a.dtype), sizes, backend=backend)  # noqa
    out = _mlp(x[tokens], weights.w1, weights.w2, weights.w_gate, activation, gm)
    gates = (routing.gates * active).reshape(-1)[order].astype(x.dtype)
    return jnp.zeros((t, d), x.dtype).at[tokens].add(out * gates[:, None])


def moe_ffn(x, routing: Routing, weights: ExpertWeights, *, mode: str = "dropless",
            capacity_factor: float = 1.25, priority: str = "choice", activation: str = "gelu",
            backend: str | None = None, mask=None, group: str = "batch",
            length: int | None = None):
    """One function, two modes: ``(y [T, d], kept bool[T, k])``; dropless keeps every active
    assignment. Capacity dispatch groups the tokens by ``group`` (``"sequence"``: rows of
    ``length``, each from a fresh :class:`CapacityState`)."""
    if mode == "capacity":
        out = moe_capacity(x, routing, weights, capacity_factor=capacity_factor,
                           priority=priority, activation=activation, mask=mask, group=group,
                           length=length)
        return out[:2]
    if mode == "dropless":
        y = moe_dropless(x, routing, weights, activation=activation, backend=backend, mask=mask)
        kept = routing.gates != 0
        return y, kept if mask is None else kept & mask[:, None]
    raise ValueError(f"moe_ffn: mode must be one of {MODES}, got {mode!r}")


def expert_choice_ffn(x, choice: ExpertChoice, weights: ExpertWeights, *,
                      activation: str = "gelu"):
    """Expert-choice dispatch: ``y_t = sum_{(e, s): tokens[e, s] = t} gates[e, s] *
    MLP_e(x_t)``. ``x [T, d]`` -> ``[T, d]``."""
    _check(x, weights, activation)
    buf = x[choice.tokens]  # [E, c, d]
    batched = lambda a, w: jnp.einsum("ecd,edh->ech", a, w.astype(a.dtype))  # noqa: E731
    out = _mlp(buf, weights.w1, weights.w2, weights.w_gate, activation, batched)
    out = out * choice.gates[..., None].astype(x.dtype)
    return jnp.zeros_like(x).at[choice.tokens.reshape(-1)].add(out.reshape(-1, x.shape[1]))
