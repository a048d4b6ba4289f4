"""Memory language models beyond a block memory, and decoding across segments.

* :class:`MemoryModel`: the base of models that are their own recurrence (the Feedback
  Transformer's memories, Memformer's slots) rather than a stack of blocks with an
  ``nn.Memory``; :func:`has_memory` tells either kind.
* :func:`generate_with_memory`: decoding a memory :class:`~xformers_jax.models.CausalLM`
  across segment boundaries, the memories as the cache of everything before the current
  segment (:class:`SegmentCache`).
* :func:`retrospective_feed`: ERNIE-Doc's two-pass reading (Ding et al., 2021).
* The model kind ``memory_lm``: a :class:`~xformers_jax.models.CausalLM` over contiguous
  streams with Transformer-XL's relative positions and the block memory its config's
  ``memory`` section names (``none``, ``xl``, ``ernie`` or ``compressive``).
"""

from __future__ import annotations

import abc
import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ..nn import (MEMORY_ATTENTION_KINDS, AttentionSpec, CompressiveMemory, Memory, MemoryState,
                  NoPositions, TransformerXLRelative, XLMemory, decode_ffn, init_ffn_cache,
                  sample_tokens, sinusoid)
from ._lm import CausalLM
from ._registry import TRUNK, register_model, section


class MemoryModel(eqx.Module):
    """Abstract: a model that is its own recurrence rather than a stack of blocks with a
    :class:`Memory` (Memformer's slots, the Feedback Transformer's memories). Like a memory
    :class:`~xformers_jax.nn.CausalLM`, ``init_memory(batch, inference=)`` gives the carried
    state (with ``reset`` and an ``aux`` loss) and ``model(tokens, memory=state) -> (logits,
    new_state)`` reads the next segment of each stream."""

    @abc.abstractmethod
    def init_memory(self, batch: int, dtype=jnp.float32, *, inference=False):
        raise NotImplementedError


def has_memory(model) -> bool:
    """Whether ``model`` carries a memory across segments: a :class:`MemoryModel`, or a model
    with a :class:`Memory` in any block."""
    if isinstance(model, MemoryModel):
        return True
    is_memory = lambda x: isinstance(x, Memory)  # noqa: E731
    return any(is_memory(x) for x in jax.tree_util.tree_leaves(model, is_leaf=is_memory))



# -- decoding across segments ------------------------------------------------------------------


class SegmentCache(eqx.Module):
    """The decoding state of a memory model (one entry per layer, on a leading layer axis):
    the ``memory`` (:class:`MemoryState`), its keys/values ``mem_k, mem_v [N, B, Mc + M, Hkv,
    Dk]`` (mask ``mem_mask``), the current segment's keys/values ``seg_k, seg_v [N, B, S, Hkv,
    Dk]`` and each layer's inputs/outputs ``x_in, x_out [N, B, S, D]`` on it (what the memory
    update reads when the segment is full), ``count``, the segment's tokens so far, and ``ffn``
    each layer's FFN decoding state (``nn.init_ffn_cache``: capacity routing's counts, which
    start afresh with every segment, as in ``model(segment, memory=)``; None when the FFN keeps
    none)."""

    memory: MemoryState
    mem_k: jax.Array
    mem_v: jax.Array
    mem_mask: jax.Array
    seg_k: jax.Array
    seg_v: jax.Array
    x_in: jax.Array
    x_out: jax.Array
    count: jax.Array
    ffn: Any = None


def _layer_memory_kv(block, state: MemoryState):
    """One layer's memory keys/values (in the attention's input space, like ``__call__``)."""
    ctx, mask = state.context()
    ctx = block.norms[0](ctx) if block.placement == "pre" else ctx
    _, k, v = block.attn.project(ctx[:, :1], ctx)
    return k, v, mask


def _segment_cache(model, memory: MemoryState, segment_len: int) -> SegmentCache:
    """A decoding state at the start of a segment, after ``memory``."""
    dynamic, static = model.layers.per_layer()
    mk, mv, mmask = jax.vmap(lambda p, m: _layer_memory_kv(eqx.combine(p, static), m))(
        dynamic, memory)
    n, b = mmask.shape[:2]
    d = model.embed.table.shape[1]
    zeros = lambda *shape: jnp.zeros((n, b, segment_len, *shape), mk.dtype)  # noqa: E731
    ffn = jax.vmap(lambda p: init_ffn_cache(eqx.combine(p, static).ffn, b))(dynamic)
    return SegmentCache(memory, mk, mv, mmask, zeros(*mk.shape[3:]), zeros(*mv.shape[3:]),
                        zeros(d), zeros(d), jnp.zeros((), jnp.int32), ffn)


def _next_segment(model, cache: SegmentCache) -> SegmentCache:
    """Shifts the full segment into every layer's memory (the block's own update)."""
    dynamic, static = model.layers.per_layer()
    memory = jax.vmap(lambda p, m, x, y: eqx.combine(p, static).update_memory(m, x, y))(
        dynamic, cache.memory, cache.x_in, cache.x_out)
    return _segment_cache(model, memory, cache.seg_k.shape[2])


def _memory_decode_step(model, token, cache: SegmentCache):
    """One token ``int[B]`` of a memory model at the segment's position ``cache.count``:
    ``(logits [B, vocab], cache)``, the segment's keys/values kept, not recomputed."""
    seg = cache.seg_k.shape[2]
    cache = jax.lax.cond(cache.count == seg, lambda c: _next_segment(model, c), lambda c: c,
                         cache)
    c = cache.count
    x, _ = model.embed(token[:, None], causal=True, offset=c)
    stack = model.layers
    dynamic, static = stack.per_layer()
    b = token.shape[0]
    m = cache.mem_k.shape[2]
    q_pos = jnp.full((b, 1), c, jnp.int32)
    k_pos = jnp.broadcast_to(jnp.concatenate([jnp.arange(-m, 0, dtype=jnp.int32),
                                              jnp.arange(seg, dtype=jnp.int32)]), (b, m + seg))
    put = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
        buf, new.astype(buf.dtype), c, axis=1)

    def layer(x, inputs):
        params, t, mk, mv, mmask, sk, sv, xin, xout, fc = inputs
        block = eqx.combine(params, static)
        if stack.universal:
            x = x + sinusoid(t, x.shape[-1]).astype(x.dtype)
        kv = {}

        def attend(h):
            q, k, v = block.attn.project(h, None)
            kv["k"], kv["v"] = put(sk, k), put(sv, v)
            keys = jnp.concatenate([mk, kv["k"]], 1).astype(q.dtype)
            values = jnp.concatenate([mv, kv["v"]], 1).astype(q.dtype)
            mask = jnp.concatenate([mmask, jnp.broadcast_to(jnp.arange(seg) <= c, (b, seg))], 1)
            return block.attn.output(block.attn.exact_heads(q, keys, values, q_pos, k_pos,
                                                            mask))

        def ffn(h):
            y, kv["ffn"] = decode_ffn(block.ffn, h, fc, tokens=token[:, None])
            return y

        fs = block.sublayers(inference=True)
        fs[0], fs[-1] = attend, ffn
        y = x
        for i, f in enumerate(fs):
            y = block.residual(i, y, f)
        return y, (kv["k"], kv["v"], put(xin, x), put(xout, y), kv["ffn"])

    xs = (dynamic, jnp.arange(stack.num_layers), cache.mem_k, cache.mem_v, cache.mem_mask,
          cache.seg_k, cache.seg_v, cache.x_in, cache.x_out, cache.ffn)
    x, (sk, sv, xin, xout, ffn) = jax.lax.scan(layer, x, xs)
    h = x if model.final_norm is None else model.final_norm(x)
    logits = (h @ model.output_weights().astype(h.dtype))[:, 0]
    return logits, SegmentCache(cache.memory, cache.mem_k, cache.mem_v, cache.mem_mask, sk, sv,
                                xin, xout, c + 1, ffn)


def generate_with_memory(model, prompt, max_new_tokens: int, *, segment_len: int, key=None,
                         temperature: float = 1.0, top_k: int | None = None,
                         inference: bool = True):
    """Extends ``prompt int[B, P]`` by ``max_new_tokens`` with a memory model (a
    :class:`~xformers_jax.nn.CausalLM` whose blocks have a memory), continuing across segment
    boundaries with the memories as the cache of everything before the current segment.

    The prompt's full segments (``segment_len`` tokens each) are read in parallel; the rest of
    the prompt and the new tokens go one at a time into the current segment, whose keys and
    values are cached (:class:`SegmentCache`): each token costs one position's forward, its
    attention over ``M + segment_len`` keys, independent of how long the text already is.
    When the segment is full its layer inputs are shifted into the memories (the blocks' own
    update, as in ``model(segment, memory=)``) and a new segment starts. The token choice is
    :func:`~xformers_jax.nn.sample_tokens`' (greedy when ``key`` is None, else sampled from
    ``softmax(logits / temperature)`` over the ``top_k`` most likely). Memories have their
    evaluation lengths when ``inference``. Returns ``int[B, P + max_new_tokens]``."""

    b, p = prompt.shape
    if p < 1:
        raise ValueError("generate_with_memory: the prompt needs at least one token")
    memory = model.init_memory(b, inference=inference)
    full = p // segment_len
    last = None
    for s in range(full):
        logits, memory = model(prompt[:, s * segment_len:(s + 1) * segment_len], memory=memory)
        last = logits[:, -1]
    cache = _segment_cache(model, memory, segment_len)
    step = lambda tok, cache, _=None: _memory_decode_step(model, tok, cache)  # noqa: E731
    if p > full * segment_len:
        cache, logits = jax.lax.scan(lambda c, t: step(t, c)[::-1], cache,
                                     prompt[:, full * segment_len:].T)
        last = logits[-1]
    new = sample_tokens(step, last, cache, 0, max_new_tokens, key=key, temperature=temperature,
                        top_k=top_k, dtype=prompt.dtype)
    return jnp.concatenate([prompt, new], axis=1)


def retrospective_feed(model, tokens, *, segment_len: int, mask=None, inference=False):
    """ERNIE-Doc's retrospective feed (Ding et al., 2021): a skimming pass reads the document
    ``tokens int[B, S * segment_len]`` segment by segment, then a retrospective pass reads it
    again starting from the skimming pass's final memory, so every segment of the second pass
    sees (through the memory) a summary of the whole document. Returns the second pass's
    ``(outputs [B, S * segment_len, ...], memory)``; ``model(segment, memory=) -> (out,
    memory)`` (e.g. a memory :class:`~xformers_jax.nn.CausalLM`; use it with
    ``XLMemory(same_layer=True)``, the enhanced recurrence).

    The second pass sees later text, so its outputs are for document understanding
    (classification, retrieval), not next-token prediction."""
    b, n = tokens.shape
    if n % segment_len:
        raise ValueError(f"retrospective_feed: document length {n} is not a multiple of "
                         f"segment_len={segment_len}")
    cuts = [slice(s, s + segment_len) for s in range(0, n, segment_len)]
    memory = model.init_memory(b, inference=inference)
    for c in cuts:  # skimming
        _, memory = model(tokens[:, c], mask=None if mask is None else mask[:, c],
                          memory=memory)
    outs = []
    for c in cuts:  # retrospective
        out, memory = model(tokens[:, c], mask=None if mask is None else mask[:, c],
                            memory=memory)
        outs.append(out)
    return jnp.concatenate(outs, 1), memory


# -- the model kind: a memory LM over streams --------------------------------------------------

MEMORY_KINDS = ("none", "xl", "ernie", "compressive")
_MEMORY_KEYS = {"none": {"kind"}, "xl": {"kind", "mem_len", "eval_mem_len", "clamp_len"},
                "ernie": {"kind", "mem_len", "eval_mem_len", "clamp_len"},
                "compressive": {"kind", "mem_len", "eval_mem_len", "cmem_len", "eval_cmem_len",
                                "rate", "compression", "clamp_len"}}


def _memory_lengths(mem):
    get = lambda k, d=0: int(mem.get(k, d))  # noqa: E731
    m = get("mem_len")
    return m, get("eval_mem_len", m), get("cmem_len"), get("eval_cmem_len", get("cmem_len"))


def _block_memory(mem: dict, dim: int):
    """The block memory a ``memory`` config section names (None for kind ``"none"``): an
    ``nn.XLMemory`` (``xl``, ``ernie``: ERNIE-Doc's same-layer recurrence) or a builder of an
    ``nn.CompressiveMemory``; unknown kinds and keys raise ValueError."""
    kind = mem.get("kind", "none")
    if kind not in MEMORY_KINDS:
        raise ValueError(f"model.memory.kind must be one of {MEMORY_KINDS}, got {kind!r}")
    known = _MEMORY_KEYS[kind]
    if set(mem) - known:
        raise ValueError(f"model.memory: unknown keys {sorted(set(mem) - known)} for kind "
                         f"{kind!r} (known: {sorted(known)})")
    m, em, c, ec = _memory_lengths(mem)
    if kind == "none":
        return None
    if kind in ("xl", "ernie"):
        return XLMemory(m, em, same_layer=kind == "ernie")
    return functools.partial(CompressiveMemory, dim, m, c, int(mem.get("rate", 2)),
                             compression=mem.get("compression", "conv"), eval_mem_len=em,
                             eval_cmem_len=ec)


@register_model("memory_lm", serves=("stream_language_model",),
                defaults=dict(TRUNK, attention=dict(kind="dot_product"),
                              memory=dict(kind="none")),
                loss_weights={"reconstruction_loss": 1.0})
def memory_lm(config, task, key):
    """A causal LM over streams with relative positions and a block memory (Transformer-XL)."""
    mem = section(config, "memory")
    memory = _block_memory(mem, config.dim)  # checks the keys
    # Relative positions (Transformer-XL's, with u and v) and no input positions: segments
    # carry no absolute position, memories sit at negative offsets.
    mm, em, cc, ec = _memory_lengths(mem)
    em = max([em, *getattr(task.validation, "eval_mem_lens", ())])
    longest = task.seq_len + max(em, mm) + max(ec, cc)
    # Distances past the longest one training sees read as it (Transformer-XL's clamp_len):
    # a no-op in training, and what lets a longer evaluation memory help (-1: no clamp).
    clamp = int(mem.get("clamp_len", task.seq_len + mm + cc - 1))
    if clamp < -1:
        raise ValueError(f"model.memory.clamp_len must be -1 (no clamp) or a distance >= 0, "
                         f"got {clamp}")
    position = TransformerXLRelative(config.num_heads, config.dim // config.num_heads, longest,
                                     clamp_len=None if clamp == -1 else clamp,
                                     key=jax.random.fold_in(key, 1))
    attention = section(config, "attention")
    block = dict(spec=AttentionSpec.from_config(attention), position=position)
    if memory is not None:
        if attention["kind"] not in MEMORY_ATTENTION_KINDS:
            raise ValueError(f"model.memory.kind={mem['kind']!r} needs an exact softmax "
                             f"attention, one of {MEMORY_ATTENTION_KINDS}; got "
                             f"model.attention.kind={attention['kind']!r}")
        block["memory"] = memory
    return CausalLM(task.vocab_size, config.dim, config.num_layers, config.num_heads,
                    config.hidden, positions=NoPositions(), max_len=longest, block=block,
                    key=key)
