"""Routers: which experts each token goes to, and with what gate (router math in float32).

Every token-choice router returns a :class:`Routing` over ``T`` tokens and ``E`` experts:
``experts int32[T, k]`` (slot 0 is the first choice), ``gates float32[T, k]`` (the combine
weights; 0 for a slot that is switched off), ``probs float32[T, E]`` (the full router softmax,
for the load-balancing loss) and ``logits float32[T, E]`` (for the router z-loss).

Gates (implementations differ; this library's choice, tested in tests/test_experts.py):

* top-1 (Switch): the gate is the raw softmax probability of the chosen expert (renormalising
  over one expert would give 1 and cut the router's gradient).
* top-k with k > 1 (GShard, ST-MoE, GLaM): the k chosen probabilities are renormalised to sum
  to 1 over the k slots (``renormalize=True``, the default); ``renormalize=False`` keeps the
  raw probabilities. Dropping by capacity (``_dispatch``) happens afterwards and never
  renormalises again: a dropped slot's share goes to the residual.

Causal safety: the token-choice routers (``top_k_route``, ``hash_route``,
``prototype_route``) decide each token from that token alone, so they are causal-safe; whether
capacity dropping is depends on the priority order (see ``_dispatch``). Expert choice
(``expert_choice_route``) ranks tokens against each other over the whole batch, so a token's
output depends on later tokens: it is NOT causal-safe and the layers raise when used causally.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

ROUTER_DTYPE = jnp.float32


class Routing(NamedTuple):
    """A token-choice routing decision over ``T`` tokens, ``E`` experts, ``k`` slots."""

    experts: jax.Array  # int32 [T, k]
    gates: jax.Array  # float32 [T, k]
    probs: jax.Array  # float32 [T, E]
    logits: jax.Array  # float32 [T, E]


def _check_2d(name, x):
    if x.ndim != 2:
        raise ValueError(f"{name}: expected a [tokens, dim] array, got shape {x.shape}")


def router_logits(x, w, *, jitter: float = 0.0, key=None):
    """``x [T, d] @ w [d, E]`` in float32. With ``jitter > 0`` and a ``key`` the router input
    is multiplied by uniform noise in ``[1 - jitter, 1 + jitter]`` (Fedus et al., 2021, "Switch
    Transformers", multiplicative jitter; 1e-2 there). Returns ``float32 [T, E]``."""
    _check_2d("router_logits", x)
    if w.ndim != 2 or w.shape[0] != x.shape[1]:
        raise ValueError(f"router_logits: router weight must be [dim, experts] with dim "
                         f"{x.shape[1]}, got {w.shape}")
    x = x.astype(ROUTER_DTYPE)
    if jitter > 0 and key is not None:
        x = x * jax.random.uniform(key, x.shape, ROUTER_DTYPE, 1.0 - jitter, 1.0 + jitter)
    return x @ w.astype(ROUTER_DTYPE)


def top_k_route(logits, k: int, *, renormalize: bool = True, second_policy: str = "all",
                mask=None, key=None) -> Routing:
    """Token-choice top-``k`` routing (Shazeer et al., 2017, "Outrageously Large Neural
    Networks"; Switch: k=1, Fedus et al., 2021; GShard: k=2, Lepikhin et al., 2020; ST-MoE:
    k=2, Zoph et al., 2022).

    Args:
      logits: ``[T, E]`` router logits. k: experts per token (``1 <= k <= E``).
      renormalize: for k > 1, divide the k chosen probabilities by their sum (see the module
        docstring; ignored for k = 1, whose gate is the raw probability).
      second_policy: ``"all"`` keeps every slot; ``"random"`` (GShard) keeps the slots after
        the first with probability ``min(1, 2 * gate)`` (the renormalised gate) when a ``key``
        is given (training) and always without one (inference).
      mask: ``bool[T]``, False for padding: padded tokens get gate 0 (and are excluded from the
        losses and from capacity by the callers).
    """
    _check_2d("top_k_route", logits)
    t, e = logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"top_k_route: k must be in [1, {e}] for {e} experts, got {k}")
    if second_policy not in ("all", "random"):
        raise ValueError(f"top_k_route: second_policy must be 'all' or 'random', got "
                         f"{second_policy!r}")
    logits = logits.astype(ROUTER_DTYPE)
    probs = jax.nn.softmax(logits, axis=-1)
    top, experts = jax.lax.top_k(probs, k)
    gates = top / top.sum(-1, keepdims=True) if (k > 1 and renormalize) else top
    if second_policy == "random" and k > 1 and key is not None:
        u = jax.random.uniform(key, (t, k - 1))
        keep = u < jnp.minimum(1.0, 2.0 * gates[:, 1:])
        gates = gates.at[:, 1:].multiply(keep)
    if mask is not None:
        gates = gates * mask[:, None]
    return Routing(experts.astype(jnp.int32), gates, probs, logits)


def prototype_route(logits, groups: int, *, mask=None) -> Routing:
    """Expert prototyping (Yang et al., 2021, "M6-T: Exploring Sparse Expert Models and
    Beyond"): the ``E`` experts form ``groups`` equal groups, each with its own softmax over
    its ``E / groups`` experts and a top-1 choice; the token's output sums the groups' experts
    weighted by their in-group probabilities. ``k = groups`` slots (slot g is group g's
    choice); ``probs`` is the in-group softmax divided by ``groups`` (it sums to 1)."""
    _check_2d("prototype_route", logits)
    t, e = logits.shape
    if groups < 1 or e % groups:
        raise ValueError(f"prototype_route: {e} experts do not split into {groups} groups")
    logits = logits.astype(ROUTER_DTYPE)
    per = e // groups
    p = jax.nn.softmax(logits.reshape(t, groups, per), axis=-1)
    choice = jnp.argmax(p, axis=-1)
    gates = jnp.take_along_axis(p, choice[..., None], -1)[..., 0]
    experts = choice + per * jnp.arange(groups)
    if mask is not None:
        gates = gates * mask[:, None]
    return Routing(experts.astype(jnp.int32), gates, p.reshape(t, e) / groups, logits)


def balanced_hash_table(vocab_size: int, num_experts: int, seed: int = 0) -> np.ndarray:
    """A fixed balanced hash of token ids (Roller et al., 2021, "Hash Layers For Large Sparse
    Models"): a seeded random permutation of the vocabulary dealt round-robin to the experts,
    so each expert owns ``floor`` or ``ceil(vocab_size / num_experts)`` ids. ``int32[V]``."""
    perm = np.random.default_rng(seed).permutation(vocab_size)
    table = np.empty(vocab_size, np.int32)
    table[perm] = np.arange(vocab_size) % num_experts
    return table


def hash_route(token_ids, table, num_experts: int, *, mask=None) -> Routing:
    """Hash routing: token id -> ``table[id mod len(table)]`` (see
    :func:`balanced_hash_table`), gate 1, no learned router. ``token_ids int[T]``; ``probs``
    is the one-hot assignment and ``logits`` zero (the losses are constants). Ids beyond the
    table (a vocabulary larger than the kind's ``vocab_size``) wrap around, so they spread
    over the experts like the others (an index past the end would be clamped by XLA, sending
    every such id to the last entry's expert)."""
    if token_ids.ndim != 1:
        raise ValueError(f"hash_route: token_ids must be [tokens], got shape {token_ids.shape}")
    table = jnp.asarray(table)
    experts = table[token_ids % table.shape[0]][:, None].astype(jnp.int32)
    gates = jnp.ones(experts.shape, ROUTER_DTYPE)
    if mask is not None:
        gates = gates * mask[:, None]
    probs = jax.nn.one_hot(experts[:, 0], num_experts, dtype=ROUTER_DTYPE)
    return Routing(experts, gates, probs, jnp.zeros_like(probs))


class ExpertChoice(NamedTuple):
    """Expert-choice routing: expert ``e`` takes tokens ``tokens[e]`` with ``gates[e]``."""

    tokens: jax.Array  # int32 [E, c]
    gates: jax.Array  # float32 [E, c] (0 for unused buffer slots)
    probs: jax.Array  # float32 [T, E]
    logits: jax.Array  # float32 [T, E]


def expert_choice_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """``c = ceil(capacity_factor * T / E)`` tokens per expert (Zhou et al., 2022: each token
    is processed by ``capacity_factor`` experts on average)."""
    return max(1, int(np.ceil(capacity_factor * num_tokens / num_experts)))


def expert_choice_route(logits, capacity_factor: float = 2.0, *, mask=None) -> ExpertChoice:
    """Expert choice (Zhou et al., 2022, "Mixture-of-Experts with Expert Choice Routing"): the
    softmax over experts per token, then each expert takes its top-``c`` tokens by that score
    (``c`` from :func:`expert_choice_capacity` with T the number of REAL tokens, so the padded
    amount changes nothing). Not causal-safe: an expert's top-c ranks every token of the batch
    against the others."""
    _check_2d("expert_choice_route", logits)
    t, e = logits.shape
    logits = logits.astype(ROUTER_DTYPE)
    probs = jax.nn.softmax(logits, axis=-1)
    c_static = min(t, expert_choice_capacity(t, e, capacity_factor))
    score = probs if mask is None else jnp.where(mask[:, None], probs, -1.0)
    top, tokens = jax.lax.top_k(score.T, c_static)  # [E, c]
    gates = jnp.maximum(top, 0.0)
    if mask is not None:
        real = mask.sum()
        c_dyn = jnp.maximum(1, jnp.ceil(capacity_factor * real / e)).astype(jnp.int32)
        gates = jnp.where(jnp.arange(c_static)[None] < c_dyn, gates, 0.0)
    return ExpertChoice(tokens.astype(jnp.int32), gates, probs, logits)
