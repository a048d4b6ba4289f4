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
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ._models import Embedder, _finish, _stack
from ._norms import LayerNorm


class Memformer(eqx.Module):
    """A causal LM over segments with ``num_slots`` memory slots (module docstring).

    ``model(tokens [B, L], slots [B, K, D]) -> (logits [B, L, vocab], new slots)``;
    :meth:`init_memory` gives the learned initial slots for a batch.
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

    def __init__(self, vocab_size, dim, num_layers, num_heads, hidden, *, num_slots: int,
                 positions=None, max_len=512, block=None, key):
        if dim % num_heads:
            raise ValueError(f"Memformer: dim={dim} is not divisible by num_heads={num_heads}")
        k = jax.random.split(key, 8)
        self.embed = Embedder(dim, vocab_size=vocab_size, positions=positions, key=k[0])
        self.layers, self.final_norm = _stack(dim, num_layers, num_heads, hidden, causal=True,
                                              cross=True, max_len=max_len, block=block,
                                              stack=None, key=k[1])
        self.head = jax.random.normal(k[2], (dim, vocab_size)) / math.sqrt(dim)
        self.slots = jax.random.normal(k[3], (num_slots, dim)) / math.sqrt(dim)
        self.wq, self.wk, self.wv, self.wo = (jax.random.normal(kk, (dim, dim)) / math.sqrt(dim)
                                              for kk in k[4:8])
        self.write_norm = LayerNorm(dim)
        self.num_heads = num_heads

    def init_memory(self, batch: int):
        """The learned initial slots ``[B, K, D]``."""
        return jnp.broadcast_to(self.slots, (batch, *self.slots.shape))

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

    def __call__(self, tokens, slots, *, mask=None, key=None):
        x, _ = self.embed(tokens, mask=mask, causal=True)
        h = self.layers(x, kv_mask=mask, context=slots.astype(x.dtype), key=key)
        new = self.write(slots, h.astype(slots.dtype), mask)
        h = _finish(self.final_norm, h)
        return h @ self.head.astype(h.dtype), new


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
