"""BASE layers' balanced assignment (Lewis et al., 2021, "BASE Layers: Simplifying Training of
Large, Sparse Models").

In training every expert takes the same number of tokens: the token -> expert assignment
maximises the total affinity ``sum_t s[t, a_t]`` (``s = x W_router``, float32) subject to each
expert taking exactly ``T / E`` tokens, a linear assignment problem over ``T`` tokens and
``E * ceil(T / E)`` expert slots (each expert's score repeated over its slots). At inference the
paper routes greedily (each token to its highest-affinity expert). The layer's output is
``y_t = sigmoid(s[t, a_t]) * MLP_{a_t}(x_t)`` (the residual is the block's), so the router is
trained through the gate; the assignment itself carries no gradient. BASE has no auxiliary
loss (balance is enforced, not encouraged).

**The solve** (:func:`balanced_assignment`): a Jacobi auction (Bertsekas, 1988, "The auction
algorithm") with "similar objects": each expert's ``C`` slots have prices; every unassigned
token bids for the cheapest slot of its best expert (value ``s - price``), raising that price
by the difference between its best and second-best values plus ``eps`` (the second best may
be the expert's second-cheapest slot); each expert gives its cheapest slots to its highest
bids in one round and the displaced tokens bid again. Epsilon scaling (``eps`` divided by
``eps_factor`` per phase, prices kept, assignments restarted) reaches the final ``eps``. All
in ``jnp`` under ``jax.lax.while_loop``, so it runs inside ``jit``.

It is **epsilon-optimal, not exact**: at the end every token's slot is within ``eps`` of its
best slot at the final prices (epsilon complementary slackness), so the total affinity is
within ``T_real * eps`` of the optimum (default ``eps = 1e-4`` in logit units). With integer
scores and ``eps < 1 / T`` it would be exact; with float scores it equals the exact solution
(scipy's ``linear_sum_assignment`` on the expanded matrix, tested) whenever no other
assignment comes within ``T * eps`` of the optimum.

Padding: padded tokens take no slot and never bid; capacity is ``ceil(T_real / E)`` slots per
expert (exactly ``T_real / E`` tokens when ``E`` divides ``T_real``; otherwise some experts take
one fewer: up to ``E - 1`` dummy tokens of zero affinity fill the spare slots, keeping the
problem square as the auction's optimality needs), so the real tokens' assignment does not
depend on the padded amount.

Causal safety: none. The assignment ranks every token of the batch against the others (a
token's expert depends on later tokens), so the BASE layer raises when used causally.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._routers import ROUTER_DTYPE, Routing, _check_2d


def _auction_phase(s, real, avail, price, eps, max_rounds):
    """One epsilon phase from empty assignments: ``(slot_of int32[T], price [E, C])``."""
    t, e = s.shape
    c = price.shape[1]
    rows = jnp.arange(e)[:, None]
    inf = jnp.inf

    def cond(st):
        slot_of, _, _, it = st
        return jnp.any(real & (slot_of < 0)) & (it < max_rounds)

    def body(st):
        slot_of, owner, price, it = st
        p = jnp.where(avail, price, inf)  # [E, C]; unavailable slots are never bid on
        if c > 1:
            low = -jax.lax.top_k(-p, 2)[0]
            p1, p2 = low[:, 0], low[:, 1]
        else:
            p1, p2 = p[:, 0], jnp.full((e,), inf)
        v = s - p1[None]  # value of each expert's cheapest slot, [T, E]
        if e > 1:
            top, idx = jax.lax.top_k(v, 2)
            v1, j1, v_other = top[:, 0], idx[:, 0], top[:, 1]
        else:
            v1, j1, v_other = v[:, 0], jnp.zeros((t,), jnp.int32), jnp.full((t,), -inf)
        s1 = jnp.take_along_axis(s, j1[:, None], 1)[:, 0]
        v2 = jnp.maximum(v_other, s1 - p2[j1])  # second-best slot: elsewhere or j1's next
        v2 = jnp.where(jnp.isfinite(v2), v2, v1 - 1.0)  # a lone slot: any bid will do
        bid = s1 - v2 + eps
        bidding = real & (slot_of < 0)
        bids = jnp.where(bidding[None] & (j1[None] == rows), bid[None], -inf)  # [E, T]
        bv, bt = jax.lax.top_k(bids, c)  # each expert's best bids, highest first
        order = jnp.argsort(p, axis=1)  # its slots, cheapest first
        sp = jnp.take_along_axis(p, order, 1)
        accept = bv > sp  # a prefix: bids fall and prices rise along the ranks
        old = jnp.take_along_axis(owner, order, 1)
        out = jnp.where(accept & (old >= 0), old, t)  # displaced holders (t: nobody)
        slot_of = slot_of.at[out.reshape(-1)].set(-1, mode="drop")
        new = jnp.where(accept, bt, t)
        slot_of = slot_of.at[new.reshape(-1)].set((rows * c + order).reshape(-1), mode="drop")
        owner = owner.at[rows, order].set(jnp.where(accept, bt, old))
        price = price.at[rows, order].set(jnp.where(accept, bv, jnp.take_along_axis(
            price, order, 1)))
        return slot_of, owner, price, it + 1

    init = (jnp.full((t,), -1, jnp.int32), jnp.full((e, c), -1, jnp.int32), price,
            jnp.zeros((), jnp.int32))
    slot_of, owner, price, _ = jax.lax.while_loop(cond, body, init)
    # A guard, not the algorithm: should the round limit stop the auction, the tokens still
    # without a slot take the free available slots in order (keeps the balance exact).
    free = (owner < 0) & avail
    need = real & (slot_of < 0)
    free_rank = jnp.where(free.reshape(-1), jnp.cumsum(free.reshape(-1)) - 1, e * c)
    slot_by_rank = jnp.full((e * c + 1,), -1, jnp.int32).at[free_rank].set(
        jnp.arange(e * c, dtype=jnp.int32), mode="drop")
    need_rank = jnp.where(need, jnp.cumsum(need) - 1, e * c)
    slot_of = jnp.where(need, slot_by_rank[need_rank], slot_of)
    return slot_of, price


def balanced_assignment(scores, *, mask=None, eps: float = 1e-4, eps_factor: float = 4.0,
                        max_rounds: int | None = None):
    """BASE's balanced assignment (see the module docstring): ``scores float[T, E]`` ->
    ``experts int32[T]`` with every expert taking ``ceil(T_real / E)`` or fewer real tokens
    (exactly ``T_real / E`` when ``E`` divides it) and the total score within
    ``T_real * eps`` of the best such assignment. Padded tokens (``mask`` False) get their
    argmax expert and take no slot. No gradient flows through the assignment."""
    _check_2d("balanced_assignment", scores)
    if eps <= 0 or eps_factor <= 1:
        raise ValueError(f"balanced_assignment: need eps > 0 and eps_factor > 1, got eps={eps}, "
                         f"eps_factor={eps_factor}")
    t, e = scores.shape
    s = jax.lax.stop_gradient(scores).astype(ROUTER_DTYPE)
    real = jnp.ones((t,), bool) if mask is None else mask.astype(bool)
    c = -(-t // e)
    c_dyn = (real.sum() + e - 1) // e
    avail = jnp.broadcast_to(jnp.arange(c)[None] < c_dyn, (e, c))
    lo = jnp.min(jnp.where(real[:, None], s, jnp.inf))
    hi = jnp.max(jnp.where(real[:, None], s, -jnp.inf))
    span = jnp.where(real.any(), hi - lo, 0.0)
    rounds = max_rounds if max_rounds is not None else 64 * t + 1024
    # The auction is optimal for a square problem (every slot taken); with fewer real tokens
    # than the E * ceil(T_real / E) slots (at most E - 1 fewer), dummy tokens of zero affinity
    # to every expert take the spare slots (from a start with prices left by a coarser phase
    # an unfilled slot could otherwise keep a price no token would pay).
    if e > 1:
        need = e * c_dyn - real.sum()
        s = jnp.concatenate([s, jnp.zeros((e - 1, e), s.dtype)])
        real = jnp.concatenate([real, jnp.arange(e - 1) < need])

    def phase(st):
        price, eps_ran, _ = st
        eps_c = jnp.maximum(eps_ran / eps_factor, eps)
        slot_of, price = _auction_phase(s, real, avail, price, eps_c, rounds)
        return price, eps_c, slot_of

    # Epsilon scaling: the first phase runs at span / eps_factor, each next one at eps / factor
    # of the last (prices kept), the last one at eps itself.
    eps0 = jnp.maximum(span / eps_factor, eps).astype(ROUTER_DTYPE)
    init = (jnp.zeros((e, c), ROUTER_DTYPE), eps0 * eps_factor, jnp.full((t,), -1, jnp.int32))
    init = init[:2] + (jnp.full((s.shape[0],), -1, jnp.int32),)
    _, _, slot_of = jax.lax.while_loop(lambda st: st[1] > eps, phase, init)
    slot_of, s = slot_of[:t], s[:t]
    experts = jnp.where(slot_of >= 0, slot_of // c, jnp.argmax(s, -1))
    return experts.astype(jnp.int32)


def base_route(logits, *, balanced: bool = True, mask=None, eps: float = 1e-4) -> Routing:
    """BASE routing over ``logits [T, E]`` (the affinities ``x W_router``): the balanced
    assignment (training) or greedy top-1 (``balanced=False``, inference); one slot per token,
    gate ``sigmoid(logits[t, a_t])``. ``probs`` is the router softmax (statistics only: BASE
    adds no load-balancing loss)."""
    _check_2d("base_route", logits)
    logits = logits.astype(ROUTER_DTYPE)
    experts = (balanced_assignment(logits, mask=mask, eps=eps) if balanced
               else jnp.argmax(logits, -1).astype(jnp.int32))
    gates = jax.nn.sigmoid(jnp.take_along_axis(logits, experts[:, None], 1))
    if mask is not None:
        gates = gates * mask[:, None]
    return Routing(experts[:, None], gates, jax.nn.softmax(logits, -1), logits)
