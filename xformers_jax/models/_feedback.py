"""The Feedback Transformer (Fan et al., 2020, "Addressing Some Limitations of Transformers with
Feedback Memory").

Every layer attends to one memory vector per past position, the learned softmax-weighted sum of
all layers' states at that position (Lin et al., 2022, "A Survey of Transformers", eq. 47):

    m_t = sum_{l=0}^{N} softmax(w)_l h_t^{(l)}        (h^{(0)}: the embeddings)

so even the lowest layer at position ``t`` sees the highest layer's representation of earlier
positions. Layer ``l`` at position ``t`` attends over ``[m_{t-tau} .. m_{t-1}; h_t^{(l-1)}]``
(the past memories in its own key/value projections, and its own input, so that the first
position has a key).

Cost: ``m_t`` needs every layer at ``t``, and every layer at ``t + 1`` needs ``m_t``, so the
computation is sequential over positions (a ``lax.scan`` over time with a cache of the memories'
keys and values, one per layer): training does ``L`` dependent steps of ``N`` layers instead of
one parallel pass, each step ``O(tau)`` attention per layer. On parallel hardware it trains far
slower than a Transformer of the same size (the paper's motivation for small ``tau`` and shared
key/value projections); decoding costs the same as a Transformer's.

Carried across segments (``model(tokens, memory=state)``, :meth:`FeedbackLM.init_memory`), the
state is every layer's ring of the last ``mem_len`` memories' keys and values, so a segment's
first positions see the memories of the previous segment's last positions; input positions
count from the start of each stream.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import attention as A
from ..nn import Embedder, KVCache, decode_ffn, get_kind, transformer_stack
from ._memory_lm import MemoryModel
from ._registry import SLOTS, TRUNK, block_kwargs, register_model
from ._trunk import finish


class FeedbackState(eqx.Module):
    """The Feedback Transformer's carried state: every layer's ring ``caches`` of memory
    keys/values (stacked on a leading layer axis) and ``start int32[B]``, the cache position at
    which each row's stream (re)started (older memories are invisible to it). ``aux`` is 0
    (no auxiliary loss)."""

    caches: KVCache
    start: jax.Array
    aux: jax.Array

    def reset(self, reset) -> "FeedbackState":
        """This state with the rows where ``reset bool[B]`` is True starting afresh."""
        now = jnp.max(self.caches.index)  # every layer's cache is at the same position
        return FeedbackState(self.caches, jnp.where(reset, now, self.start), self.aux)


class FeedbackLM(MemoryModel):
    """A causal LM with feedback memory (see the module docstring).

    Args:
      vocab_size, dim, num_layers, num_heads, hidden: sizes. mem_len: how many past memories
        each position sees (``tau``; None: all). positions: input position scheme (sinusoidal
        by default). block: :class:`TransformerBlock` keyword arguments (``dot_product``
        attention; position schemes on the inputs only). key: PRNG key.
    """

    embed: Embedder
    layers: eqx.Module
    final_norm: eqx.Module | None
    head: jax.Array
    layer_weights: jax.Array
    mem_len: int | None = eqx.field(static=True)

    def __init__(self, vocab_size, dim, num_layers, num_heads, hidden, *, mem_len=None,
                 positions=None, max_len=512, block=None, key):
        block = dict(block or {})
        spec = block.get("spec")
        if block.get("position") is not None or (spec is not None
                                                 and spec.kind != "dot_product"):
            raise ValueError("FeedbackLM: blocks use dot_product attention with input "
                             "positions only (the feedback memory is its own attention)")
        ffn = block.get("ffn")
        if ffn is not None and get_kind("ffn", ffn.kind).family == "experts":
            raise ValueError(
                f"FeedbackLM: FFN kind {ffn.kind!r} is a mixture of experts, whose auxiliary "
                "losses (load balancing, router z) and routing state the Feedback "
                "Transformer's position-by-position scan does not collect; use a dense, "
                "product_key or sparse_ffn FFN")
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = Embedder(dim, vocab_size=vocab_size, positions=positions, key=k1)
        self.layers, self.final_norm = transformer_stack(
            dim, num_layers, num_heads, hidden, causal=True, max_len=max_len, block=block,
            key=k2)
        self.head = jax.random.normal(k3, (dim, vocab_size)) / jnp.sqrt(dim)
        self.layer_weights = jnp.zeros((num_layers + 1,))
        self.mem_len = mem_len

    def init_cache(self, batch: int, length: int, dtype=jnp.float32):
        """Every layer's cache of memory keys/values (a ring of ``mem_len`` when set)."""
        dynamic, static = self.layers.per_layer()
        ring = self.mem_len is not None
        capacity = self.mem_len if ring else length

        def one(p):
            attn = eqx.combine(p, static).attn
            return KVCache.empty(batch, capacity, attn.num_kv_heads, attn.head_dim,
                                 attn.head_dim, dtype, ring=ring)

        return eqx.filter_vmap(one)(dynamic)

    def init_memory(self, batch: int, dtype=jnp.float32, *, inference=False):
        """An empty carried state (:class:`FeedbackState`) for ``batch`` streams."""
        if self.mem_len is None:
            raise ValueError("FeedbackLM: a memory carried across segments needs mem_len (the "
                             "ring of past memories each position sees)")
        return FeedbackState(self.init_cache(batch, self.mem_len, dtype),
                             jnp.zeros((batch,), jnp.int32), jnp.zeros((), jnp.float32))

    def step(self, token, caches, position, valid_from=None):
        """One position: ``token int[B]`` -> ``(logits [B, vocab], caches)`` (the memory of
        this position is appended to every layer's cache). ``position``: the input position
        (a scalar or ``int[B]``); ``valid_from int32[B]``: each row sees only memories written
        at cache positions ``>= valid_from`` (None: all)."""
        position = jnp.asarray(position)
        offset = position[:, None] if position.ndim else position
        x, _ = self.embed(token[:, None], causal=True, offset=offset)
        dynamic, static = self.layers.per_layer()
        cache_dyn, cache_static = eqx.partition(caches, eqx.is_array)

        def layer(x, inputs):
            params, cache = inputs
            block = eqx.combine(params, static)
            cache = eqx.combine(cache, cache_static)

            def attend(h):
                q, k, v = block.attn.project(h, None)
                keys = jnp.concatenate([cache.keys(), k.astype(cache.k.dtype)], 1)
                values = jnp.concatenate([cache.values(), v.astype(cache.v.dtype)], 1)
                valid = jnp.broadcast_to(cache.valid, keys.shape[:1] + cache.valid.shape)
                if valid_from is not None:
                    valid = valid & (cache.pos[None] >= valid_from[:, None])
                mask = jnp.concatenate([valid, jnp.ones((keys.shape[0], 1), bool)], 1)
                o = A.multihead(A.dot_product_attention)(q, keys.astype(q.dtype),
                                                        values.astype(q.dtype), kv_mask=mask)
                return block.attn.output(o)

            x = block.residual(0, x, attend)
            x = block.residual(1, x, lambda h: decode_ffn(block.ffn, h, None)[0])
            return x, x

        top, states = jax.lax.scan(layer, x, (dynamic, cache_dyn))
        states = jnp.concatenate([x[None], states], 0)  # [N + 1, B, 1, D]
        w = jax.nn.softmax(self.layer_weights.astype(jnp.float32)).astype(x.dtype)
        memory = jnp.einsum("n,nbld->bld", w, states)

        def write(params, cache):
            block = eqx.combine(params, static)
            cache = eqx.combine(cache, cache_static)
            h = block.norms[0](memory) if block.placement == "pre" else memory
            _, k, v = block.attn.project(h, None)
            return eqx.filter(cache.append(k, v), eqx.is_array)

        caches = eqx.combine(jax.vmap(write)(dynamic, cache_dyn), cache_static)
        h = finish(self.final_norm, top)
        return (h @ self.head.astype(h.dtype))[:, 0], caches

    def __call__(self, tokens, *, caches=None, start: int = 0, memory=None, key=None,
                 return_aux=False):
        """Logits ``[B, L, vocab]`` for ``tokens int[B, L]``, scanning over positions; with
        ``caches`` (from :meth:`init_cache` or an earlier call, at position ``start``) returns
        ``(logits, caches)`` so a document can be fed in pieces or extended by decoding. With
        ``memory`` (a :class:`FeedbackState`) ``tokens`` is the next segment of each stream
        and the result is ``(logits, new state)``. ``return_aux`` adds the (empty) auxiliary
        outputs: ``(that, {})``."""
        out = self._forward(tokens, caches=caches, start=start, memory=memory)
        return (out, {}) if return_aux else out

    def _forward(self, tokens, *, caches, start, memory):
        b, length = tokens.shape
        if memory is not None:
            if caches is not None:
                raise ValueError("FeedbackLM: pass caches or memory, not both")
            now = jnp.max(memory.caches.index)

            def stream(caches, t):
                tok, i = t
                logits, caches = self.step(tok, caches, now + i - memory.start,
                                           valid_from=memory.start)
                return caches, logits

            caches, logits = jax.lax.scan(stream, memory.caches,
                                          (tokens.T, jnp.arange(length, dtype=jnp.int32)))
            state = FeedbackState(jax.lax.stop_gradient(caches), memory.start, memory.aux)
            return jnp.moveaxis(logits, 0, 1), state
        given = caches is not None
        caches = self.init_cache(b, length) if caches is None else caches

        def body(caches, inputs):
            tok, t = inputs
            logits, caches = self.step(tok, caches, t)
            return caches, logits

        caches, logits = jax.lax.scan(body, caches, (tokens.T, start + jnp.arange(length)))
        logits = jnp.moveaxis(logits, 0, 1)
        return (logits, caches) if given else logits


@register_model("feedback", serves=("stream_language_model",),
                defaults=dict(TRUNK, mem_len=None, **SLOTS))
def feedback(config, task, key):
    """The Feedback Transformer over streams (:class:`FeedbackLM`, memories carried)."""
    # Sinusoidal input positions counted along each stream; mem_len None: the segment length.
    mem_len = task.seq_len if config.mem_len is None else int(config.mem_len)
    return FeedbackLM(task.vocab_size, config.dim, config.num_layers, config.num_heads,
                      config.hidden, mem_len=mem_len, block=block_kwargs(config), key=key)
