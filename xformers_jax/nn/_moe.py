"""Sparse and capacity FFN layers for the block's ``ffn=`` slot (see :mod:`._ffns` for the
call contract and how their auxiliary losses reach the trainer).

* :class:`MoEFeedForward`: a mixture of expert MLPs over the routers and dispatch modes of
  :mod:`xformers_jax.experts` (Switch, GShard, ST-MoE, top-k, expert choice, hash, expert
  prototyping, BASE layers). The layer of the kinds ``switch``, ``gshard``, ``st_moe``,
  ``expert_choice``, ``hash``, ``prototype``, ``base`` (their records, with each kind's
  router and defaults, are in ``xformers_jax.experts.KINDS``).
* :class:`ProductKeyMemory`: Lample et al. (2019), "Large Memory Layers with Product Keys"
  (kind ``product_key``).
* :class:`SparseFeedForward`: the sparse FFN of Jaszczur et al. (2021), "Sparse is Enough in
  Scaling Transformers" (kind ``sparse_ffn``).
* :class:`NoFeedForward`: the empty FFN of all-attention blocks (kind ``none``; the attention
  layer with persistent memory is ``nn.AllAttention``).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import axes as X
from .. import experts as M
from ._slots import implements

ROUTERS = ("top_k", "expert_choice", "hash", "prototype", "base")


@implements("switch", "gshard", "st_moe", "expert_choice", "hash", "prototype", "base")
class MoEFeedForward(eqx.Module):
    """A mixture-of-experts FFN: ``y_t = sum_j gate_tj * MLP_{e_tj}(x_t)``.

    Args:
      dim, hidden: model width and each expert's MLP width. num_experts: ``E``.
      router: ``"top_k"`` (token choice; ``k``, ``renormalize``, ``second_policy``),
        ``"expert_choice"`` (not causal-safe: raises with ``causal=True``), ``"hash"``
        (``vocab_size``, ``hash_seed``; needs the token ids), ``"prototype"`` (``groups``) or
        ``"base"`` (BASE layers, Lewis et al., 2021: a balanced assignment in training calls,
        greedy top-1 otherwise, gate ``sigmoid(affinity)``, no auxiliary loss; ``base_eps``
        is the auction's epsilon, see ``experts._balanced``; not causal-safe: raises with
        ``causal=True``).
      mode: ``"dropless"`` (grouped matmul, ``backend``) or ``"capacity"``
        (``capacity_factor``, ``priority``, ``capacity_group``); see
        ``xformers_jax.experts._dispatch``.
      capacity_group: which tokens share an expert's capacity: ``"sequence"`` (each row on its
        own, a running capacity by position: causal, row-independent, decodes with the counts
        as state; with k > 1 it needs ``priority="token"``) or ``"batch"`` (GShard/Switch: the
        call's ``B * L`` tokens as one group: mixes rows and counts later tokens, so a causal
        layer raises). None: ``"sequence"`` when ``causal``, else ``"batch"``.
      jitter: multiplicative router-input noise in training (Switch: 1e-2).
      activation: ``"gelu"``, ``"relu"``, ``"swish"``; ``gated=True`` for GLU-style experts.
    Call: ``x [B, L, dim]`` -> ``(y [B, L, dim], aux)`` (:data:`._ffns.MOE_AUX`); ``tokens
    int[B, L]`` for hash routing. Decoding: ``init_cache(batch)`` (a ``CapacityState`` for
    ``"sequence"`` capacity, None when routing keeps no state) and ``decode(x [B, 1, dim],
    cache, tokens=) -> (y, cache)``. Under an active mesh with an ``expert`` axis of size > 1
    the layer runs expert-parallel (``experts.expert_parallel_moe``: experts split over
    ``expert``, tokens exchanged by ``all_to_all``; ``"batch"`` capacity has one routing group
    per device, ``"sequence"`` capacity gives the same result as one device); that form
    supports the top-k router with capacity dispatch and no jitter or random second choice,
    and raises otherwise.
    """

    w_router: jax.Array | None = X.param(X.EMBED, X.EXPERTS)
    w1: jax.Array = X.param(X.EXPERTS, X.EMBED, X.MLP)
    w2: jax.Array = X.param(X.EXPERTS, X.MLP, X.EMBED)
    w_gate: jax.Array | None = X.param(X.EXPERTS, X.EMBED, X.MLP)
    # The token-id -> expert table (a static tuple: no parameter, hashable for jit).
    hash_table: tuple | None = eqx.field(static=True)
    num_experts: int = eqx.field(static=True)
    router: str = eqx.field(static=True)
    k: int = eqx.field(static=True)
    mode: str = eqx.field(static=True)
    capacity_factor: float = eqx.field(static=True)
    priority: str = eqx.field(static=True)
    capacity_group: str = eqx.field(static=True)
    renormalize: bool = eqx.field(static=True)
    second_policy: str = eqx.field(static=True)
    groups: int = eqx.field(static=True)
    jitter: float = eqx.field(static=True)
    activation: str = eqx.field(static=True)
    backend: str | None = eqx.field(static=True)
    base_eps: float = eqx.field(static=True)

    def __init__(self, dim: int, hidden: int, *, num_experts: int = 8, router: str = "top_k",
                 k: int = 1, mode: str = "dropless", capacity_factor: float = 1.25,
                 priority: str = "choice", renormalize: bool = True, second_policy: str = "all",
                 groups: int = 1, jitter: float = 0.0, activation: str = "gelu",
                 gated: bool = False, backend: str | None = None, vocab_size: int = 256,
                 hash_seed: int = 0, base_eps: float = 1e-4, capacity_group: str | None = None,
                 causal: bool = False, key):
        if router not in ROUTERS:
            raise ValueError(f"MoEFeedForward: router must be one of {ROUTERS}, got {router!r}")
        if mode not in M.DISPATCH_MODES:
            raise ValueError(f"MoEFeedForward: mode must be one of {M.DISPATCH_MODES}, got "
                             f"{mode!r}")
        if router == "expert_choice" and causal:
            raise ValueError("MoEFeedForward: expert choice ranks every token of the batch "
                             "against the others, so it is not causal-safe (causal=True)")
        if router == "base" and causal:
            raise ValueError("MoEFeedForward: BASE's balanced assignment is solved over every "
                             "token of the batch (a token's expert depends on later tokens), so "
                             "it is not causal-safe (causal=True)")
        slots = {"top_k": k, "prototype": groups}.get(router, 1)
        if capacity_group is None:
            capacity_group = "sequence" if causal else "batch"
        if capacity_group not in M.CAPACITY_GROUPS:
            raise ValueError(f"MoEFeedForward: capacity_group must be one of "
                             f"{M.CAPACITY_GROUPS} or None, got {capacity_group!r}")
        if causal and mode == "capacity" and capacity_group == "batch":
            raise ValueError("MoEFeedForward: capacity_group='batch' routes the call's B x L "
                             "tokens as one group, so a token's expert depends on other rows "
                             "and on later tokens: not causal-safe (causal=True); use "
                             "capacity_group='sequence' or mode='dropless'")
        if mode == "capacity" and capacity_group == "sequence" and slots > 1 \
                and priority != "token":
            raise ValueError(f"MoEFeedForward: capacity_group='sequence' admits a row's "
                             f"assignments token by token, so with {slots} choices per token "
                             f"priority='choice' (every first choice before any second, which "
                             f"lets a token's later choices depend on later tokens) does not "
                             f"apply: use priority='token' or mode='dropless'")
        if router == "prototype" and num_experts % groups:
            raise ValueError(f"MoEFeedForward: {num_experts} experts do not split into "
                             f"{groups} groups")
        kr, kw = jax.random.split(key)
        self.w_router = (None if router == "hash"
                         else jax.random.normal(kr, (dim, num_experts)) * 0.02)
        w = M.init_expert_weights(kw, num_experts, dim, hidden, gated=gated)
        self.w1, self.w2, self.w_gate = w.w1, w.w2, w.w_gate
        self.hash_table = (tuple(M.balanced_hash_table(vocab_size, num_experts,
                                                       hash_seed).tolist())
                           if router == "hash" else None)
        self.num_experts, self.router, self.k, self.mode = num_experts, router, k, mode
        self.capacity_factor, self.priority = capacity_factor, priority
        self.capacity_group = capacity_group
        self.renormalize, self.second_policy, self.groups = renormalize, second_policy, groups
        self.jitter, self.activation, self.backend = jitter, activation, backend
        self.base_eps = base_eps

    def route(self, x, *, mask=None, tokens=None, key=None, inference=False):
        """The routing decision for ``x [T, dim]`` (a ``Routing`` or ``ExpertChoice``)."""
        train = key is not None and not inference
        kj, ks = jax.random.split(key) if train else (None, None)
        if self.router == "hash":
            if tokens is None:
                raise ValueError("MoEFeedForward: hash routing needs the token ids (tokens=)")
            return M.hash_route(tokens, jnp.asarray(self.hash_table, jnp.int32), self.num_experts,
                                mask=mask)
        logits = M.router_logits(x, self.w_router, jitter=self.jitter, key=kj)
        if self.router == "expert_choice":
            return M.expert_choice_route(logits, self.capacity_factor, mask=mask)
        if self.router == "prototype":
            return M.prototype_route(logits, self.groups, mask=mask)
        if self.router == "base":
            return M.base_route(logits, balanced=train, mask=mask, eps=self.base_eps)
        return M.top_k_route(logits, self.k, renormalize=self.renormalize,
                             second_policy=self.second_policy, mask=mask, key=ks)

    @property
    def _sequence_capacity(self) -> bool:
        return self.mode == "capacity" and self.capacity_group == "sequence" \
            and self.router not in ("expert_choice", "base")

    def init_cache(self, batch: int, max_len: int | None = None, dtype=None):
        """The decoding state for ``batch`` rows: a fresh ``experts.CapacityState`` for
        ``"sequence"`` capacity, None when routing keeps no state (dropless: each token is
        routed on its own)."""
        del max_len, dtype
        return M.CapacityState.empty(batch, self.num_experts) if self._sequence_capacity \
            else None

    def decode(self, x, cache, *, tokens=None):
        """One decoding step ``x [B, 1, dim]`` (``tokens int[B, 1]`` for hash routing) with
        the state of :meth:`init_cache`: ``(y, cache)``, equal to the step's position of the
        full-sequence call."""
        y, _, cache = self._run(x, None, tokens, None, True, cache)
        return y, cache

    def __call__(self, x, *, mask=None, tokens=None, key=None, inference=False):
        y, aux, _ = self._run(x, mask, tokens, key, inference, None)
        return y, aux

    def _run(self, x, mask, tokens, key, inference, cache):
        b, length, d = x.shape
        if mask is not None:  # padded rows selected out: a router's 0 * nan is NaN
            x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
        xf = x.reshape(b * length, d)
        m = None if mask is None else mask.reshape(-1)
        t = None if tokens is None else tokens.reshape(-1)
        if X.mesh_axis_size(X.EXPERT) > 1:
            if cache is not None:
                raise ValueError("MoEFeedForward: the expert-parallel form does not decode")
            y, aux = self._expert_parallel(xf, m, length)
            return y.reshape(b, length, d), aux, None
        r = self.route(xf, mask=m, tokens=t, key=key, inference=inference)
        w = M.ExpertWeights(self.w1, self.w2, self.w_gate)
        real = jnp.ones((b * length,), bool) if m is None else m
        if self.router == "expert_choice":
            y = M.expert_choice_ffn(xf, r, w, activation=self.activation)
            picked = jnp.zeros((b * length,), bool).at[r.tokens.reshape(-1)].max(
                r.gates.reshape(-1) > 0)
            dropped = 1.0 - (picked & real).sum() / jnp.maximum(real.sum(), 1)
            hits = (r.gates > 0).sum(1).astype(jnp.float32)
            aux = dict(load_balancing=jnp.zeros(()), router_z=M.router_z_loss(r.logits, mask=m),
                       dropped_fraction=dropped, expert_load=hits / jnp.maximum(hits.sum(), 1))
            return y.reshape(b, length, d), aux, None
        if self._sequence_capacity:
            y, kept, cache = M.moe_capacity(
                xf, r, w, capacity_factor=self.capacity_factor, activation=self.activation,
                mask=m, group="sequence", length=length, state=cache)
        else:
            y, kept = M.moe_ffn(xf, r, w, mode=self.mode, capacity_factor=self.capacity_factor,
                                priority=self.priority, activation=self.activation,
                                backend=self.backend, mask=m)
        active = (r.gates != 0) & real[:, None]
        # BASE layers balance by construction and add no auxiliary loss.
        no_loss = self.router == "base"
        aux = dict(
            load_balancing=(jnp.zeros(()) if no_loss
                            else M.load_balancing_loss(r.probs, r.experts, mask=m)),
            router_z=jnp.zeros(()) if no_loss else M.router_z_loss(r.logits, mask=m),
            dropped_fraction=1.0 - kept.sum() / jnp.maximum(active.sum(), 1),
            expert_load=M.expert_load(r.experts, self.num_experts, mask=m, kept=active))
        return y.reshape(b, length, d), aux, cache

    def _expert_parallel(self, xf, m, length):
        unsupported = [name for name, bad in (
            ("router != 'top_k'", self.router != "top_k"), ("mode != 'capacity'",
                                                             self.mode != "capacity"),
            ("jitter", self.jitter > 0), ("second_policy='random'",
                                          self.second_policy != "all")) if bad]
        if unsupported:
            raise ValueError(f"MoEFeedForward: the expert-parallel form (a mesh with an "
                             f"'expert' axis) does not support {unsupported}")
        w = M.ExpertWeights(self.w1, self.w2, self.w_gate)
        return M.expert_parallel_moe(xf, self.w_router, w, k=self.k,
                                     capacity_factor=self.capacity_factor,
                                     priority=self.priority, renormalize=self.renormalize,
                                     activation=self.activation, mask=m,
                                     length=length if self._sequence_capacity else None)


@implements("product_key")
class ProductKeyMemory(eqx.Module):
    """A product-key memory layer (Lample et al., 2019) in the FFN slot:
    ``y = sum_h sum_{top-k slots} softmax(scores) * values[slot]``, queries ``x Wq`` per head.

    Args: dim, hidden (unused; the memory's size is ``n_keys^2`` rows of width ``dim``),
    ``n_keys`` (``n``, sub-keys per half), ``heads``, ``k`` (slots per head), ``key_dim``
    (query width, even). Call: ``(y [B, L, dim], {})``.
    """

    wq: jax.Array = X.param(X.EMBED, None)
    keys1: jax.Array
    keys2: jax.Array
    values: jax.Array = X.param(None, X.EMBED)
    heads: int = eqx.field(static=True)
    k: int = eqx.field(static=True)

    def __init__(self, dim: int, hidden: int = 0, *, n_keys: int = 128, heads: int = 4,
                 k: int = 32, key_dim: int = 128, activation: str = "gelu",
                 causal: bool = False, key):
        del hidden, activation, causal
        if key_dim % 2:
            raise ValueError(f"ProductKeyMemory: key_dim must be even, got {key_dim}")
        if not 1 <= k <= n_keys:
            raise ValueError(f"ProductKeyMemory: k must be in [1, n_keys={n_keys}], got {k}")
        kq, k1, k2, kv = jax.random.split(key, 4)
        self.wq = jax.random.normal(kq, (dim, heads * key_dim)) / math.sqrt(dim)
        half = key_dim // 2
        self.keys1 = jax.random.normal(k1, (heads, n_keys, half)) / math.sqrt(half)
        self.keys2 = jax.random.normal(k2, (heads, n_keys, half)) / math.sqrt(half)
        self.values = jax.random.normal(kv, (n_keys * n_keys, dim)) / math.sqrt(dim)
        self.heads, self.k = heads, k

    def __call__(self, x, *, mask=None, tokens=None, key=None, inference=False):
        b, length, d = x.shape
        q = (x.reshape(-1, d) @ self.wq.astype(x.dtype)).reshape(b * length, self.heads, -1)
        y = M.product_key_lookup(q, self.keys1.astype(x.dtype), self.keys2.astype(x.dtype),
                                 self.values.astype(x.dtype), self.k)
        return y.reshape(b, length, d), {}


@implements("sparse_ffn")
class SparseFeedForward(eqx.Module):
    """The sparse FFN of Scaling Transformers (Jaszczur et al., 2021) over
    ``experts.sparse_feed_forward``: the ``hidden`` units form ``hidden / block`` blocks and a
    low-rank controller ``(x C1) C2`` picks one unit per block; the others are zeroed: ``y =
    (relu(x W1 + b1) * onehot) W2 + b2``. Training uses a straight-through Gumbel-softmax over
    each block (with a key), inference the argmax and computes only the chosen units (a gather
    of ``hidden / block`` columns of ``W1`` and rows of ``W2`` per token).
    """

    w1: jax.Array = X.param(X.EMBED, X.MLP)
    b1: jax.Array = X.param(X.MLP)
    w2: jax.Array = X.param(X.MLP, X.EMBED)
    b2: jax.Array = X.param(X.EMBED)
    c1: jax.Array = X.param(X.EMBED, None)
    c2: jax.Array = X.param(None, X.MLP)
    block: int = eqx.field(static=True)

    def __init__(self, dim: int, hidden: int, *, block: int = 32, rank: int = 64,
                 activation: str = "relu", causal: bool = False, key):
        del activation, causal
        if hidden % block:
            raise ValueError(f"SparseFeedForward: hidden={hidden} is not a multiple of "
                             f"block={block}")
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.w1 = jax.random.normal(k1, (dim, hidden)) / math.sqrt(dim)
        self.w2 = jax.random.normal(k2, (hidden, dim)) / math.sqrt(hidden // block)
        self.b1, self.b2 = jnp.zeros((hidden,)), jnp.zeros((dim,))
        self.c1 = jax.random.normal(k3, (dim, rank)) / math.sqrt(dim)
        self.c2 = jax.random.normal(k4, (rank, hidden)) / math.sqrt(rank)
        self.block = block

    def controller(self, x):
        """Controller logits ``[..., hidden / block, block]`` (float32)."""
        return M.sparse_controller(x, self.c1, self.c2, self.block)

    def dense_masked(self, x, onehot):
        """The masked dense form: ``(relu(x W1 + b1) * onehot) W2 + b2``."""
        return M.sparse_masked(x, onehot, self.w1, self.b1, self.w2, self.b2)

    def __call__(self, x, *, mask=None, tokens=None, key=None, inference=False):
        train = key is not None and not inference
        return M.sparse_feed_forward(x, self.w1, self.b1, self.w2, self.b2, self.c1, self.c2,
                                     block=self.block, key=key if train else None), {}


@implements("none")
class NoFeedForward(eqx.Module):
    """The empty FFN (all-attention blocks, Sukhbaatar et al., 2019): ``y = 0``, so the FFN
    sublayer's residual adds nothing."""

    def __init__(self, dim: int = 0, hidden: int = 0, *, activation: str = "gelu",
                 causal: bool = False, key=None):
        del dim, hidden, activation, causal, key

    def __call__(self, x, *, mask=None, tokens=None, key=None, inference=False):
        return M.no_feed_forward(x), {}

