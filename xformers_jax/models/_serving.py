"""Serving a causal model: decoding rows of different lengths, continuous batching, a paged
key/value cache and prefix reuse, for every kind that decodes.

One interface across slots. A model that decodes (``init_cache(batch, max_len)`` and
``decode_step(token, caches, position)``, e.g. :class:`~xformers_jax.models.CausalLM`) is run
one sequence at a time under ``jax.vmap`` over a leading *sequence* axis of its caches: each
sequence then has its own position, so rows of different lengths decode side by side whatever
the slot holds (a key/value cache, a ring buffer, a recurrent state, a mixture of experts'
capacity counts), with no kind-specific code here. A model with ``for_decoding()`` (the same
model laid out for decoding steps: ``CausalLM.for_decoding``) is served in that layout.

Alignment: prompts are left-aligned (position 0 is each row's first token, padding on the
right). Every row's positions are then those it has decoded alone, which absolute positions,
rotary angles, decays and recurrent states need to give the same outputs; a row whose prompt
is shorter simply stops being fed (its cache is held) while the longer ones go on
(:func:`prefill_rows`). Right-aligned prompts would shift positions or feed padding into
recurrent states, which no mask can undo.

:class:`Server` runs requests of different prompt and output lengths on ``num_slots`` slots.
Each step feeds every busy slot its next tokens: a chunk of up to ``prefill_chunk`` prompt
tokens, with the generating slots' decoding carried along in the same step (chunked prefill,
as in Agrawal et al., 2024, "Sarathi-Serve"; one compiled step serves prefill and
generation), so a request joins a free slot at any step and leaves when done (continuous
batching, Yu et al., 2022, "Orca");
``policy="lockstep"`` admits a new batch only when the whole previous one has finished, for
comparison. With ``page_size`` the exact and windowed kinds keep keys and values in a pool of
fixed-size pages (Kwon et al., 2023, "PagedAttention"): a page table per sequence, a free list,
pages freed when a sequence ends (and, for a window, as they slide out of it). A
:class:`Prefix` is a shared prompt's cache (its pages, or any kind's state after it) that later
requests start from instead of recomputing it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..nn import KVCache, MultiHeadAttention, PagedKVCache, pick_token


def cache_bytes(cache) -> int:
    """Bytes held by the arrays of a decoding cache (any pytree; ``jax.ShapeDtypeStruct``
    leaves from ``jax.eval_shape`` count as the arrays they describe)."""
    return int(sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                   for a in jax.tree_util.tree_leaves(cache) if hasattr(a, "dtype")))


def decode_compiler_options() -> dict:
    """XLA options for a program that updates a decoding cache in place (pass them to
    ``jax.jit(..., compiler_options=...)``; ``Server`` does).

    A decoding step reads the cache and writes one slot of it. On XLA:CPU the default copy
    insertion gives the write its own copy of every buffer that is also read in the program
    (the whole cache, each step); its region analysis
    (``xla_cpu_copy_insertion_use_region_analysis``) orders the read before the in-place write
    instead. Empty on other backends."""
    if jax.default_backend() == "cpu":
        return {"xla_cpu_copy_insertion_use_region_analysis": True}
    return {}


def sequence_cache_bytes(model, max_len: int, dtype=jnp.float32) -> int:
    """Bytes of one sequence's decoding cache for ``max_len`` tokens (nothing is allocated):
    grows with ``max_len`` for a key/value cache, is constant for a window's ring buffer and a
    recurrent state."""
    return cache_bytes(jax.eval_shape(lambda m: m.init_cache(1, max_len, dtype), model))


# -- rows of different lengths -----------------------------------------------------------------

def _one(model, cache, token, position):
    """One sequence's step: ``token int[]`` at ``position`` over its batch-1 ``cache``."""
    logits, cache = model.decode_step(token[None], cache, position)
    return logits, cache


def _is_kv(x) -> bool:
    return isinstance(x, KVCache)


def _appends_only(model) -> bool:
    """Whether a decoding step of ``model`` changes each key/value cache only at the slot it
    appends to (no attention layer rewrites its cached keys, ``rewrites_cache``)."""
    layers = jax.tree_util.tree_leaves(model,
                                       is_leaf=lambda x: isinstance(x, MultiHeadAttention))
    return not any(m.rewrites_cache for m in layers if isinstance(m, MultiHeadAttention))


def _held_step(model, cache, token, position, fed, appends: bool):
    """One sequence's step (:func:`_one`) that, where not ``fed`` (a bool scalar), leaves its
    cache holding what it held.

    A key/value cache that the step only appends to (``appends``) keeps its positions and
    index, and the one slot the step wrote, at its index, is zeroed: that slot is dead, never
    read before the sequence's next step writes it (past the cache's tokens, unused and zero
    since the cache was made empty; or, in a window's ring, the entry the next step evicts
    and does not read). So an idle slot costs its step no pass over its cache: selecting the
    whole old cache instead kept it alive beside the new one, a copy of every slot's cache
    per step. (Restoring the slot's old contents needs a read of the old cache that XLA
    fuses after the write, which copies the cache again.) Other leaves (recurrent states,
    capacity counts, and every leaf of a kind that rewrites its cached keys) are selected
    whole."""
    old, treedef = jax.tree_util.tree_flatten(cache, is_leaf=_is_kv)
    logits, new = _one(model, cache, token, position)

    def where(n, o):
        return jnp.where(fed, n, o)

    def keep(n, o):
        if not (appends and _is_kv(n)):
            return jax.tree_util.tree_map(where, n, o)
        t = o.index % o.pos.shape[0]

        def zeroed(a):
            wrote = jax.lax.dynamic_slice_in_dim(a, t, 1, axis=2)
            return jax.lax.dynamic_update_slice_in_dim(a, where(wrote, jnp.zeros_like(wrote)),
                                                       t, axis=2)

        return KVCache(zeroed(n.k), zeroed(n.v), where(n.pos, o.pos), where(n.index, o.index),
                       n.ring)

    held = [keep(n, o) for n, o in zip(treedef.flatten_up_to(new), old)]
    return logits, treedef.unflatten(held)


def init_rows(model, rows: int, max_len: int, dtype=jnp.float32):
    """Empty caches for ``rows`` sequences of at most ``max_len`` tokens each: the model's
    batch-1 cache with a leading sequence axis (see :func:`step_rows`)."""
    one = model.init_cache(1, max_len, dtype)
    return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (rows, *a.shape)), one)


def step_rows(model, caches, tokens, positions, active=None):
    """One decoding step for sequences at their own positions.

    Args:
      model: a model with ``decode_step`` (``CausalLM``). caches: from :func:`init_rows`
        (``[S, ...]`` per leaf). tokens: ``int[S]``. positions: ``int[S]``, each row's position
        (the tokens it holds). active: ``bool[S]`` (default all): rows not active keep what
        their cache holds, at no pass over it (a key/value cache's one slot the step wrote
        is zeroed, a dead slot: see :func:`_held_step`).
    Returns:
      ``(logits [S, vocab], caches)``.
    """
    if active is None:
        logits, new = jax.vmap(_one, in_axes=(None, 0, 0, 0))(model, caches, tokens, positions)
    else:
        logits, new = jax.vmap(functools.partial(_held_step, appends=_appends_only(model)),
                               in_axes=(None, 0, 0, 0, 0))(model, caches, tokens, positions,
                                                           active)
    return logits[:, 0], new


def prefill_rows(model, prompts, lengths, max_len: int, dtype=jnp.float32):
    """Prefills a batch of left-aligned prompts of different lengths.

    Args:
      prompts: ``int[B, P]``, row ``b``'s prompt in its first ``lengths[b]`` entries (the rest
        is padding, never read). lengths: ``int[B]``, each at least 1. max_len: the cache's
        capacity per row (prompt plus the tokens to generate).
    Returns:
      ``(logits [B, vocab], caches)``: each row's next-token logits after its last prompt
      token, and caches at positions ``lengths`` (decode on with :func:`step_rows`).
    """
    b, p = prompts.shape
    if lengths.shape != (b,):
        raise ValueError(f"prefill_rows: lengths must be int[B] = [{b}] for prompts of shape "
                         f"{prompts.shape}, got shape {lengths.shape}")
    caches = init_rows(model, b, max_len, dtype)

    def step(carry, inputs):
        caches, last = carry
        tok, t = inputs
        active = t < lengths
        logits, caches = step_rows(model, caches, tok, jnp.full((b,), t), active)
        return (caches, jnp.where(active[:, None], logits, last)), None

    vocab = jax.eval_shape(lambda c: step_rows(model, c, prompts[:, 0], jnp.zeros((b,),
                                                                               jnp.int32)),
                           caches)[0].shape[-1]
    init = (caches, jnp.zeros((b, vocab), jnp.float32))
    (caches, logits), _ = jax.lax.scan(step, init, (prompts.T, jnp.arange(p)))
    return logits, caches


# -- the server --------------------------------------------------------------------------------

class Request(NamedTuple):
    """A request: ``prompt int[P]`` (``P >= 1``), ``max_new_tokens`` to generate, ``key`` (a
    PRNG key: sample, token ``i`` with ``jax.random.split(key, max_new_tokens)[i]`` as
    ``CausalLM.generate`` does; None: greedy) and ``prefix`` (a :class:`Prefix` whose tokens
    start the prompt, reused instead of recomputed)."""

    prompt: Any
    max_new_tokens: int
    key: Any = None
    prefix: Any = None


@dataclasses.dataclass
class Prefix:
    """A shared prompt's cache: ``tokens``, and either one sequence's ``cache`` (dense slots:
    any kind's cache or state after the prompt) or the ``pages`` holding it (paged: held until
    :meth:`Server.release_prefix`)."""

    tokens: np.ndarray
    cache: Any = None
    pages: list | None = None


@dataclasses.dataclass
class ServeStats:
    """What a :meth:`Server.run` did: ``steps`` (model calls), ``seconds`` (wall time, device
    work included), ``generated`` and ``processed`` tokens (prompt tokens fed plus generated
    ones), ``peak_pages`` in use and, for a paged cache, ``page_fill``: pages in use times the
    page size over the tokens the step reads or writes, summed over steps (1.0: no page space
    wasted)."""

    steps: int = 0
    seconds: float = 0.0
    generated: int = 0
    processed: int = 0
    peak_pages: int = 0
    page_fill: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds if self.seconds else float("nan")


class PagePool:
    """The host side of a paged cache: ``num_pages`` pages of ``page_size`` tokens, a free
    list and reference counts (a prefix's pages are shared). Page 0 is never handed out:
    unused page-table entries and idle sequences' writes point at it."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"PagePool: needs num_pages >= 2 (page 0 is the scratch page) and "
                             f"page_size >= 1, got num_pages={num_pages}, "
                             f"page_size={page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.free = list(range(num_pages - 1, 0, -1))
        self.refs = np.zeros(num_pages, np.int64)
        self.freed: list[int] = []  # pages freed since the caller last looked

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError(f"PagePool: out of pages ({self.num_pages - 1} pages of "
                               f"{self.page_size} tokens all in use); give the Server more "
                               "num_pages or fewer slots")
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def share(self, page: int) -> int:
        self.refs[page] += 1
        return page

    def release(self, page: int) -> None:
        if page == 0:
            return
        if self.refs[page] <= 0:
            raise RuntimeError(f"PagePool: page {page} released but not held")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free.append(page)
            self.freed.append(page)

    @property
    def in_use(self) -> int:
        return self.num_pages - 1 - len(self.free)


def _chunk_loop(state, model_step, tokens, from_prompt, last, count, keys, greedy, temperature,
                top_k, record):
    """A step's tokens, one after the other: slot ``s`` is fed ``count[s]`` tokens, at
    iteration ``j`` its prompt's ``tokens[s, j]`` where ``from_prompt[s, j]``, else the token
    it chose at the iteration before (``last`` at ``j = 0``), and chooses its next token from
    the logits with ``keys[s, j]``. ``model_step(j, state, fed_tokens, fed) -> (state,
    logits)`` advances the slots where ``fed``. The loop runs ``max(count)`` times (once when
    no slot prefills). Returns ``(state, last, chosen int[S, T], logits [S, T, vocab])``, the
    logits only when ``record`` (None otherwise: with a large vocabulary they would be the
    step's largest output)."""
    s_n, t_n = tokens.shape

    def cond(carry):
        return carry[0] < jnp.max(count)

    def body(carry):
        j, state, last, chosen, seen = carry
        fed = j < count
        tok = jnp.where(jax.lax.dynamic_index_in_dim(from_prompt, j, 1, False),
                        jax.lax.dynamic_index_in_dim(tokens, j, 1, False), last)
        state, logits = model_step(j, state, tok, fed)
        pick = _choose(logits, jax.lax.dynamic_index_in_dim(keys, j, 1, False), greedy,
                       temperature, top_k)
        last = jnp.where(fed, pick, last)
        chosen = jax.lax.dynamic_update_index_in_dim(chosen, pick, j, 1)
        if record:
            seen = jax.lax.dynamic_update_index_in_dim(seen, logits.astype(seen.dtype), j, 1)
        return j + 1, state, last, chosen, seen

    seen = None
    if record:
        vocab = jax.eval_shape(lambda st: model_step(0, st, last, count > 0),
                               state)[1].shape[-1]
        seen = jnp.zeros((s_n, t_n, vocab), jnp.float32)
    init = (jnp.zeros((), jnp.int32), state, last, jnp.zeros((s_n, t_n), jnp.int32), seen)
    _, state, last, chosen, seen = jax.lax.while_loop(cond, body, init)
    return state, last, chosen, seen


def _dense_step(caches, model, tokens, from_prompt, last, positions, count, keys, greedy,
                temperature, top_k, record):
    # Slots not fed (idle, or past their count) keep their cache, at a position they hold:
    # one stepping on would run its position past the cache's capacity (a key/value cache
    # refuses that).
    def model_step(j, caches, tok, fed):
        logits, caches = step_rows(model, caches, tok, positions + jnp.where(fed, j, 0), fed)
        return caches, logits

    return _chunk_loop(caches, model_step, tokens, from_prompt, last, count, keys, greedy,
                       temperature, top_k, record)


def _choose(logits, keys, greedy, temperature, top_k):
    """Each row's token, by the rule ``CausalLM.generate`` uses for one sequence (its logits
    as a batch of one, so a sample equals that drawn alone)."""
    return jax.vmap(lambda lg, k: pick_token(lg[None], None if greedy else k,
                                             temperature=temperature, top_k=top_k)[0])(
        logits, keys).astype(jnp.int32)


def _paged_step(pool, model, tokens, from_prompt, last, positions, count, tables, write_page,
                write_offset, keys, greedy, temperature, top_k, record):
    # pool: one (k_pages [N, P, Hkv, Dk], v_pages [N, P, Hkv, Dv]) pair per layer, each its own
    # buffer, so that the scatter below writes every layer's pages in place.
    def one(pool, token, table, length):
        caches = tuple(
            PagedKVCache(k_pages, v_pages, table, length,
                         jnp.zeros((1, *k_pages.shape[2:]), k_pages.dtype),
                         jnp.zeros((1, *v_pages.shape[2:]), v_pages.dtype))
            for k_pages, v_pages in pool)
        logits, caches = model.decode_step(token[None], caches, length)
        return logits[0], tuple((c.new_k[0], c.new_v[0]) for c in caches)

    def model_step(j, pool, tok, fed):
        logits, new = jax.vmap(one, in_axes=(None, 0, 0, 0))(
            pool, tok, tables, positions + jnp.where(fed, j, 0))
        # slots not fed write to the scratch page 0 (write_page is 0 there)
        page = jax.lax.dynamic_index_in_dim(write_page, j, 1, False)
        offset = jax.lax.dynamic_index_in_dim(write_offset, j, 1, False)
        pool = tuple((k_pages.at[page, offset].set(new_k), v_pages.at[page, offset].set(new_v))
                     for (k_pages, v_pages), (new_k, new_v) in zip(pool, new))
        return pool, logits

    return _chunk_loop(pool, model_step, tokens, from_prompt, last, count, keys, greedy,
                       temperature, top_k, record)


def _describe(cache) -> str:
    if isinstance(cache, tuple):
        return "a tuple of " + ", ".join(sorted({type(c).__name__ for c in cache}))
    return type(cache).__name__


def _put(caches, slot, one):
    return jax.tree_util.tree_map(lambda c, o: c.at[slot].set(o), caches, one)


def _take(caches, slot):
    return jax.tree_util.tree_map(lambda c: c[slot], caches)


def _copy_page(pool, src, dst):
    return jax.tree_util.tree_map(lambda p: p.at[dst].set(p[src]), pool)


def _poison_pages(pool, pages):
    return jax.tree_util.tree_map(lambda p: p.at[pages].set(jnp.nan), pool)


_PUT = jax.jit(_put, donate_argnums=0)
_TAKE = jax.jit(_take)
_COPY_PAGE = jax.jit(_copy_page, donate_argnums=0)
_POISON = jax.jit(_poison_pages, donate_argnums=0)
_STATIC = ("greedy", "temperature", "top_k", "record")


@functools.lru_cache(maxsize=16)
def _jitted_step(step, static):
    def call(state, params, *inputs, greedy, temperature, top_k, record):
        return step(state, eqx.combine(params, static), *inputs, greedy, temperature, top_k,
                    record)

    return jax.jit(call, donate_argnums=0, static_argnames=_STATIC,
                   compiler_options=decode_compiler_options())


class Server:
    """Serves :class:`Request` s on ``num_slots`` decoding slots (continuous batching).

    Args:
      model: a causal model that decodes (``CausalLM``).
      num_slots: sequences decoded side by side. max_len: the longest request (prompt plus
        new tokens). dtype: the cache's dtype.
      page_size: None for one cache per slot sized ``max_len`` (every kind that decodes);
        an int for a paged key/value cache (exact and windowed attention kinds only), with
        ``num_pages`` pages in the pool (default: enough for every slot at ``max_len``).
      poison_freed: fill each page with NaN when it is freed (a check that a freed page is
        never read again: an output that read one would be NaN).
      prefill_chunk: prompt tokens a slot is fed per step (chunked prefill): a step is as
        long as its longest prompt chunk (at most this many tokens; one token when no slot
        prefills), and through it every slot advances as far: prefilling slots by their
        prompt's tokens (then generating, once the prompt is in), generating slots by
        generating, each token chosen inside the step from the one before. A prompt of ``P``
        tokens takes ``ceil(P / prefill_chunk)`` steps rather than ``P``. Inside the step the
        tokens are still decoded one after the other (a loop, not a parallel forward over
        the chunk): what chunks save is the steps' host work and dispatch, and, in continuous
        batching, the steps newly admitted prompts would hold the others up. Requests are
        admitted between steps. Outputs and caches equal ``prefill_chunk=1``'s.

    Compiles one step (and a slot reset/copy) per model and sampling rule.
    """

    def __init__(self, model, *, num_slots: int, max_len: int, dtype=jnp.float32,
                 page_size: int | None = None, num_pages: int | None = None,
                 poison_freed: bool = False, prefill_chunk: int = 64):
        if prefill_chunk < 1:
            raise ValueError(f"Server: prefill_chunk must be at least 1, got {prefill_chunk}")
        self.model, self.num_slots, self.max_len = model, num_slots, max_len
        self.prefill_chunk = prefill_chunk
        one = jax.eval_shape(lambda m: m.init_cache(1, max_len, dtype), model)
        self.paged = page_size is not None
        self.poison_freed = poison_freed
        if self.paged:
            if not (isinstance(one, tuple) and one
                    and all(isinstance(c, KVCache) for c in one)):
                raise ValueError(
                    f"Server: a paged cache needs every layer to decode with a key/value cache "
                    f"(exact or windowed attention kinds), but this model's cache is "
                    f"{_describe(one)}; use page_size=None (one cache per slot)")
            self.pages_per_seq = -(-max_len // page_size)
            if num_pages is None:
                num_pages = num_slots * self.pages_per_seq + 1
            self.pool_pages = PagePool(num_pages, page_size)
            # a window keeps the last `left` keys: older pages are freed as it slides
            self.window = one[0].pos.shape[-1] - 1 if one[0].ring else None
            # One (keys, values) pair of [pages, P, Hkv, D] pools per layer.
            self.pool = tuple(
                (jnp.zeros((num_pages, page_size, c.k.shape[1], c.k.shape[3]), c.k.dtype),
                 jnp.zeros((num_pages, page_size, c.v.shape[1], c.v.shape[3]), c.v.dtype))
                for c in one)
            self._step = self._compiled(_paged_step)
        else:
            self.empty = model.init_cache(1, max_len, dtype)
            self.caches = init_rows(model, num_slots, max_len, dtype)
            self._step = self._compiled(_dense_step)
        self._put, self._take = _PUT, _TAKE
        self._copy_page, self._poison = _COPY_PAGE, _POISON

    def _compiled(self, step):
        """``step(state, model, *inputs, greedy, temperature, top_k, record)`` jitted with the
        model's arrays as an argument and ``state`` (the slots' caches or the page pool)
        donated; one program per model structure, shared by every server of that model."""
        # A model's decoding layout (CausalLM.for_decoding: each layer's parameters their own
        # arrays), built once here so that no step copies them out of stacked arrays.
        model = self.model.for_decoding() if hasattr(self.model, "for_decoding") else self.model
        params, static = eqx.partition(model, eqx.is_array)
        try:
            jitted = _jitted_step(step, static)
        except TypeError:  # a model whose static part is not hashable
            jitted = _jitted_step.__wrapped__(step, static)
        return lambda state, model, *inputs: jitted(
            state, params, *inputs[:-4], greedy=inputs[-4], temperature=inputs[-3],
            top_k=inputs[-2], record=inputs[-1])

    # -- bytes --

    def bytes_per_sequence(self, tokens: int) -> int:
        """Cache bytes one sequence holding ``tokens`` tokens needs: its pages when paged
        (whole pages), its slot's cache (sized ``max_len``) otherwise."""
        if not self.paged:
            return cache_bytes(self.empty)
        p = self.pool_pages.page_size
        held = tokens if self.window is None else min(tokens, self.window + p)
        page_bytes = sum(cache_bytes(a[:1]) for a in jax.tree_util.tree_leaves(self.pool))
        return -(-held // p) * page_bytes

    # -- prefixes --

    def add_prefix(self, tokens) -> Prefix:
        """Computes the cache after ``tokens int[P]`` once, for requests that start with them
        (``Request(prefix=...)``); a paged prefix holds its pages until
        :meth:`release_prefix`."""
        tokens = np.asarray(tokens)
        if self.paged and self.window is not None:
            raise ValueError("Server.add_prefix: a windowed kind's pages slide out of the "
                             "window; prefix reuse shares the pages of exact kinds only")
        done = {}
        self._run([Request(tokens, 0)], "continuous", True, 1.0, None, record=done,
                  keep_slot=True)
        slot, pages = done["kept"]
        if self.paged:
            return Prefix(tokens, pages=pages)
        return Prefix(tokens, cache=self._take(self.caches, slot))

    def release_prefix(self, prefix: Prefix) -> None:
        """Gives a paged prefix's pages back (requests still using them keep them)."""
        for page in prefix.pages or ():
            self.pool_pages.release(page)
        prefix.pages = None
        self._poison_freed()

    # -- running --

    def run(self, requests: Sequence[Request], *, policy: str = "continuous",
            temperature: float = 1.0, top_k: int | None = None, record_logits: bool = False):
        """Serves ``requests``; returns ``(outputs, stats)``: each request's generated tokens
        ``int[max_new_tokens]`` (and, with ``record_logits``, ``(tokens, logits [n, vocab])``,
        the logits each token was chosen from) in request order, and a :class:`ServeStats`.

        ``policy``: ``"continuous"`` (a request takes any free slot at any step) or
        ``"lockstep"`` (a batch of ``num_slots`` requests runs until its longest is done
        before the next is admitted). Sampled requests (``key``) and greedy ones may not
        mix in one run."""
        if policy not in ("continuous", "lockstep"):
            raise ValueError(f"Server.run: policy must be 'continuous' or 'lockstep', got "
                             f"{policy!r}")
        sampled = {r.key is not None for r in requests}
        if len(sampled) > 1:
            raise ValueError("Server.run: give every request a key (sampling) or none (greedy)")
        greedy = not sampled or sampled == {False}
        return self._run(requests, policy, greedy, temperature, top_k,
                         record_logits=record_logits)

    def _check(self, r: Request, i: int) -> int:
        prompt = np.asarray(r.prompt)
        start = 0 if r.prefix is None else len(r.prefix.tokens)
        if prompt.ndim != 1 or len(prompt) < 1:
            raise ValueError(f"Server: request {i}: prompt must be int[P] with P >= 1, got "
                             f"shape {prompt.shape}")
        if r.prefix is not None and not np.array_equal(prompt[:start], r.prefix.tokens):
            raise ValueError(f"Server: request {i}: its prompt does not start with its "
                             f"prefix's {start} tokens")
        if start >= len(prompt):
            raise ValueError(f"Server: request {i}: the prompt ({len(prompt)} tokens) must be "
                             f"longer than its prefix ({start})")
        if len(prompt) + r.max_new_tokens > self.max_len:
            raise ValueError(f"Server: request {i} needs {len(prompt)} + {r.max_new_tokens} "
                             f"positions, more than max_len={self.max_len}")
        return start

    def _poison_freed(self):
        pool = self.pool_pages if self.paged else None
        if pool is None or not pool.freed:
            return
        if self.poison_freed:
            self.pool = self._poison(self.pool, jnp.asarray(pool.freed, jnp.int32))
        pool.freed = []

    def _run(self, requests, policy, greedy, temperature, top_k, *, record_logits=False,
             record=None, keep_slot=False):
        s_n, chunk = self.num_slots, self.prefill_chunk
        starts = [self._check(r, i) for i, r in enumerate(requests)]
        g_max = max([r.max_new_tokens for r in requests] + [1])
        queue = list(range(len(requests)))[::-1]
        slot_req = [-1] * s_n
        pos = np.zeros(s_n, np.int32)
        tables = np.zeros((s_n, getattr(self, "pages_per_seq", 1)), np.int32)
        owned: list[list[int]] = [[] for _ in range(s_n)]
        keys = np.zeros((s_n, g_max, 2), np.uint32)
        last = jnp.zeros((s_n,), jnp.int32)
        log, outs = [], []
        stats = ServeStats()
        fill_num = fill_den = 0
        page_size = self.pool_pages.page_size if self.paged else None
        t0 = time.perf_counter()

        def admit(s, i):
            r = requests[i]
            slot_req[s] = i
            pos[s] = starts[i]
            keys[s] = 0
            if r.key is not None:
                keys[s, :r.max_new_tokens] = np.asarray(
                    jax.random.key_data(jax.random.split(r.key, r.max_new_tokens))
                    if jnp.issubdtype(r.key.dtype, jax.dtypes.prng_key)
                    else jax.random.split(r.key, r.max_new_tokens))
            if not self.paged:
                self.caches = self._put(self.caches, s, self.empty if r.prefix is None
                                        else r.prefix.cache)
                return
            tables[s] = 0
            owned[s] = []
            if r.prefix is not None:
                n = len(r.prefix.tokens)
                full = n // page_size
                for j, page in enumerate(r.prefix.pages[:full]):
                    tables[s, j] = self.pool_pages.share(page)
                    owned[s].append(page)
                if n % page_size:  # the partial page is written on: copy it
                    page = self.pool_pages.allocate()
                    self.pool = self._copy_page(self.pool, r.prefix.pages[full], page)
                    tables[s, full] = page
                    owned[s].append(page)

        def finish(s):
            i = slot_req[s]
            slot_req[s] = -1
            if self.paged:
                if keep_slot and record is not None:
                    record["kept"] = (s, list(owned[s]))
                else:
                    for page in owned[s]:
                        self.pool_pages.release(page)
                owned[s] = []
                self._poison_freed()
            elif keep_slot and record is not None:
                record["kept"] = (s, None)
            return i

        while queue or any(i >= 0 for i in slot_req):
            if policy == "continuous" or all(i < 0 for i in slot_req):
                for s in range(s_n):
                    if slot_req[s] < 0 and queue:
                        admit(s, queue.pop())
            active = np.array([i >= 0 for i in slot_req])
            busy = np.flatnonzero(active)
            n_prompt = {s: len(np.asarray(requests[slot_req[s]].prompt)) for s in busy}
            # Tokens a slot still feeds: its prompt's, then each generated one but the last.
            left = {s: max(n_prompt[s] + requests[slot_req[s]].max_new_tokens - 1,
                           n_prompt[s]) - int(pos[s]) for s in busy}
            # The step is as long as its longest prompt chunk (one token when none prefills);
            # generating slots go on generating through it rather than idling.
            length = max([min(chunk, left[s]) for s in busy if pos[s] < n_prompt[s]] + [1])
            count = np.zeros(s_n, np.int32)
            tok = np.zeros((s_n, chunk), np.int32)
            from_prompt = np.zeros((s_n, chunk), bool)
            gen = np.full((s_n, chunk), -1, np.int64)  # generated index chosen at (s, j)
            for s in busy:
                count[s] = min(length, left[s])
                prompt = np.asarray(requests[slot_req[s]].prompt)
                n = int(np.clip(n_prompt[s] - pos[s], 0, count[s]))
                tok[s, :n], from_prompt[s, :n] = prompt[pos[s]:pos[s] + n], True
                gen[s, :count[s]] = pos[s] + np.arange(count[s]) + 1 - n_prompt[s]
            step_keys = jnp.asarray(keys[np.arange(s_n)[:, None],
                                         np.clip(gen, 0, g_max - 1)].copy())
            # copies: on CPU a device array may share a numpy buffer, which the loop changes
            args = (jnp.asarray(tok), jnp.asarray(from_prompt), last, jnp.asarray(pos.copy()),
                    jnp.asarray(count))
            if self.paged:
                write_page = np.zeros((s_n, chunk), np.int32)
                write_offset = np.zeros((s_n, chunk), np.int32)
                for s in busy:
                    for f in range(count[s]):
                        j, off = divmod(int(pos[s]) + f, page_size)
                        if tables[s, j] == 0:
                            tables[s, j] = self.pool_pages.allocate()
                            owned[s].append(int(tables[s, j]))
                        write_page[s, f], write_offset[s, f] = tables[s, j], off
                stats.peak_pages = max(stats.peak_pages, self.pool_pages.in_use)
                # the tokens the step reads or writes: a window's, from before the first fed
                # token's window to the last fed token
                held = sum(int(pos[s] + count[s]) if self.window is None else
                           min(int(pos[s] + count[s]), self.window + int(count[s]))
                           for s in busy)
                fill_num += self.pool_pages.in_use * page_size
                fill_den += held
                self.pool, last, chosen, logits = self._step(
                    self.pool, self.model, *args, jnp.asarray(tables.copy()),
                    jnp.asarray(write_page), jnp.asarray(write_offset), step_keys, greedy,
                    temperature, top_k, record_logits)
            else:
                self.caches, last, chosen, logits = self._step(
                    self.caches, self.model, *args, step_keys, greedy, temperature, top_k,
                    record_logits)
            stats.steps += 1
            stats.processed += int(count.sum())
            outs.append((chosen, logits if record_logits else None))
            for s in busy:
                i = slot_req[s]
                r = requests[i]
                for j in range(count[s]):
                    if 0 <= gen[s, j] < r.max_new_tokens:
                        log.append((stats.steps - 1, s, j, i, int(gen[s, j])))
                pos[s] += count[s]
                if self.paged and self.window is not None:
                    self._slide(s, int(pos[s]), tables, owned)
                if pos[s] >= n_prompt[s] - 1 + r.max_new_tokens and pos[s] >= n_prompt[s]:
                    finish(s)
        # one transfer of every step's outputs (stacking thousands on the device compiles a
        # program with thousands of operands)
        tokens = np.stack(jax.device_get([o[0] for o in outs])) if outs else None
        seen = jax.device_get([o[1] for o in outs]) if record_logits else None
        stats.seconds = time.perf_counter() - t0
        results = [np.zeros(r.max_new_tokens, np.int32) for r in requests]
        lg = [[None] * r.max_new_tokens for r in requests]
        for step, s, j, i, g in log:
            results[i][g] = tokens[step, s, j]
            if record_logits:
                lg[i][g] = seen[step][s, j]
        stats.generated = sum(r.max_new_tokens for r in requests)
        if self.paged:
            stats.page_fill = fill_num / max(fill_den, 1)
        if record_logits:
            results = [(t, np.stack(lo) if lo else None)
                       for t, lo in zip(results, lg)]
        return results, stats

    def _slide(self, s, t, tables, owned):
        """Frees the pages of slot ``s`` that lie wholly before its window at position
        ``t`` (the window's keys are ``t - window .. t``)."""
        p = self.pool_pages.page_size
        for j in range(max(t - self.window, 0) // p):
            page = int(tables[s, j])
            if page:
                tables[s, j] = 0
                owned[s].remove(page)
                self.pool_pages.release(page)
        self._poison_freed()
