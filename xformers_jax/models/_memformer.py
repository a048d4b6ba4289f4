"""Memformer (Wu et al., 2022, "Memformer: A Memory-Augmented Transformer for Sequence
Modeling") and memory replay back-propagation.

A fixed set of ``K`` memory slots ``M [B, K, D]`` carries information across segments: every
layer of the segment's causal decoder reads the slots by cross-attention (the
:class:`~xformers_jax.nn.TransformerBlock`'s ``cross`` sublayer, with the slots as context), and
after the segment a slot-attention writer updates them: slot ``i`` attends over ``[M_i;
h_1 .. h_L]`` (itself and the segment's last hidden states, not the other slots),
``M_i' = LayerNorm(M_i + Attn(M_i, [M_i; h]))``. Unlike Transformer-XL's memory, gradients flow
through the slots from one segment to the next; :func:`memory_replay_gradients` computes them
with activation memory of one segment, whatever the number of segments.

As a trainer's carried state (``model(tokens, memory=state)``, :meth:`Memformer.init_memory`),
a training segment is read as ``segments`` consecutive pieces with gradients through the slots
from one piece to the next, each piece's forward recomputed in the backward pass (memory replay,
as a ``lax.scan`` over rematerialised pieces); the slots passed to the next training step are
detached, so back-propagation through time is truncated at ``segments`` pieces.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ..nn import Embedder, LayerNorm, MemoryState, transformer_stack
from ._memory_lm import MemoryModel
from ._registry import SLOTS, TRUNK, block_kwargs, register_model
from ._trunk import finish


class Memformer(MemoryModel):
    """A causal LM over segments with ``num_slots`` memory slots (module docstring).

    ``model(tokens [B, L], slots [B, K, D]) -> (logits [B, L, vocab], new slots)``;
    :meth:`initial_slots` gives the learned initial slots for a batch. As a carried state:
    ``model(tokens, memory=state) -> (logits, new state)`` with ``state`` a
    :class:`~xformers_jax.nn.MemoryState` from :meth:`init_memory` (``mem`` the slots, rows
    whose ``mask`` is False start from the learned slots), reading the segment as
    ``segments`` pieces of ``L / segments`` tokens with memory replay between them.
    """

    embed: Embedder
    layers: eqx.Module
    final_norm: eqx.Module | None
    head: jax.Array
    slots: jax.Array
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    write_norm: LayerNorm
    num_heads: int = eqx.field(static=True)
    segments: int = eqx.field(static=True)

    def __init__(self, vocab_size, dim, num_layers, num_heads, hidden, *, num_slots: int,
                 segments: int = 1, positions=None, max_len=512, block=None, key):
        if dim % num_heads:
            raise ValueError(f"Memformer: dim={dim} is not divisible by num_heads={num_heads}")
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
            raise ValueError(f"Memformer: segments must be an integer >= 1, got {segments!r}")
        k = jax.random.split(key, 8)
        self.embed = Embedder(dim, vocab_size=vocab_size, positions=positions, key=k[0])
        self.layers, self.final_norm = transformer_stack(
            dim, num_layers, num_heads, hidden, causal=True, cross=True, max_len=max_len,
            block=block, key=k[1])
        self.head = jax.random.normal(k[2], (dim, vocab_size)) / math.sqrt(dim)
        self.slots = jax.random.normal(k[3], (num_slots, dim)) / math.sqrt(dim)
        self.wq, self.wk, self.wv, self.wo = (jax.random.normal(kk, (dim, dim)) / math.sqrt(dim)
                                              for kk in k[4:8])
        self.write_norm = LayerNorm(dim)
        self.num_heads = num_heads
        self.segments = segments

    def initial_slots(self, batch: int):
        """The learned initial slots ``[B, K, D]``."""
        return jnp.broadcast_to(self.slots, (batch, *self.slots.shape))

    def init_memory(self, batch: int, dtype=jnp.float32, *, inference=False):
        """An empty carried state: every row starts from the learned slots."""
        k, d = self.slots.shape
        return MemoryState(jnp.zeros((batch, k, d), dtype), jnp.zeros((batch, k), bool), None,
                           None, jnp.zeros((), jnp.float32))

    def write(self, slots, h, mask=None):
        """Slot attention: slot ``i`` attends over ``[slot_i; h]`` (``h [B, L, D]``, real
        positions ``mask bool[B, L]``). Returns the new slots ``[B, K, D]``."""
        b, k, d = slots.shape
        nh, hd = self.num_heads, d // self.num_heads
        split = lambda x: x.reshape(*x.shape[:2], nh, hd)  # noqa: E731
        q = split(slots @ self.wq)
        own_k, own_v = split(slots @ self.wk), split(slots @ self.wv)
        seg_k, seg_v = split(h @ self.wk), split(h @ self.wv)
        own = jnp.einsum("bkhd,bkhd->bhk", q, own_k)[..., None]  # [B, H, K, 1]
        seg = jnp.einsum("bkhd,blhd->bhkl", q, seg_k)
        if mask is not None:
            seg = jnp.where(mask[:, None, None, :], seg, -jnp.inf)
        w = jax.nn.softmax(jnp.concatenate([own, seg], -1) / math.sqrt(hd), axis=-1)
        out = (w[..., :1].transpose(0, 2, 1, 3) * own_v
               + jnp.einsum("bhkl,blhd->bkhd", w[..., 1:], seg_v))
        return self.write_norm(slots + out.reshape(b, k, d) @ self.wo)

    def __call__(self, tokens, slots=None, *, mask=None, key=None, memory=None,
                 return_aux=False):
        """``(logits [B, L, vocab], new slots)`` for ``tokens int[B, L]`` read with ``slots
        [B, K, D]``; with ``memory`` (a carried :class:`~xformers_jax.nn.MemoryState`) ``(logits,
        new state)``; ``return_aux`` adds the (empty) auxiliary outputs: ``(that, {})``."""
        if memory is not None:
            out = self._carried(tokens, memory, mask=mask, key=key)
            return (out, {}) if return_aux else out
        x, _ = self.embed(tokens, mask=mask, causal=True)
        h = self.layers(x, kv_mask=mask, context=slots.astype(x.dtype), key=key)
        new = self.write(slots, h.astype(slots.dtype), mask)
        h = finish(self.final_norm, h)
        out = h @ self.head.astype(h.dtype), new
        return (out, {}) if return_aux else out

    def _carried(self, tokens, memory: MemoryState, *, mask, key):
        b, length = tokens.shape
        n = self.segments
        if length % n:
            raise ValueError(f"Memformer: segment length {length} is not a multiple of "
                             f"segments={n}")
        slots = jnp.where(memory.mask[..., None], memory.mem,
                          self.initial_slots(b).astype(memory.mem.dtype))
        pieces = jnp.moveaxis(tokens.reshape(b, n, length // n), 1, 0)
        masks = None if mask is None else jnp.moveaxis(mask.reshape(b, n, -1), 1, 0)
        keys = None if key is None else jax.random.split(key, n)

        # Memory replay: the backward pass recomputes one piece at a time from its slots.
        @jax.checkpoint
        def piece(slots, inputs):
            t, m, k = inputs
            logits, new = self(t, slots, mask=m, key=k)
            return new.astype(slots.dtype), logits

        slots, logits = jax.lax.scan(piece, slots, (pieces, masks, keys))
        logits = jnp.moveaxis(logits, 0, 1).reshape(b, length, -1)
        return logits, MemoryState(jax.lax.stop_gradient(slots), jnp.ones_like(memory.mask),
                                   None, None, jnp.zeros((), jnp.float32))


def memory_replay_gradients(step, params, memory, segments):
    """Memory replay back-propagation (Wu et al., 2022): the gradient of ``sum_t loss_t``
    over segments that pass a differentiable memory along, with the activations of ONE segment
    alive at a time.

    ``step(params, memory, segment) -> (loss, new_memory)``; ``segments`` is a pytree with a
    leading segment axis; ``memory`` a pytree of float arrays. The forward pass keeps only
    each segment's incoming memory; the backward pass walks the segments in reverse, re-runs
    segment ``t``'s forward from its stored memory under ``jax.vjp`` and pulls back the
    cotangent of its loss and of the memory it produced, which gives the parameters' gradient
    for that segment and the cotangent of the memory before it. Plain autodiff over the
    unrolled segments keeps every segment's activations instead.

    Returns ``(total loss, gradients with the structure of params, final memory, gradient of
    the initial memory)``.
    """
    def forward(mem, seg):
        loss, new = step(params, mem, seg)
        return new, (mem, loss)

    final, (memories, losses) = jax.lax.scan(forward, memory, segments)

    def backward(carry, inputs):
        g_params, g_mem = carry
        mem, seg = inputs
        (loss, _), pull = jax.vjp(lambda p, m: step(p, m, seg), params, mem)
        gp, gm = pull((jnp.ones_like(loss), g_mem))
        return (jax.tree_util.tree_map(jnp.add, g_params, gp), gm), None

    zeros = (jax.tree_util.tree_map(jnp.zeros_like, params),
             jax.tree_util.tree_map(jnp.zeros_like, final))
    (grads, g_memory), _ = jax.lax.scan(backward, zeros, (memories, segments), reverse=True)
    return losses.sum(), grads, final, g_memory


@register_model("memformer", serves=("stream_language_model",),
                defaults=dict(TRUNK, num_slots=8, segments=1, **SLOTS))
def memformer(config, task, key):
    """Memformer over streams (:class:`Memformer`: memory slots, memory replay)."""
    return Memformer(task.vocab_size, config.dim, config.num_layers, config.num_heads,
                     config.hidden, num_slots=int(config.num_slots),
                     segments=int(config.segments), max_len=task.seq_len,
                     block=block_kwargs(config), key=key)
