"""The encoder-decoder (sequence-to-sequence) Transformer: the encoder trunk, and a causal
decoder whose blocks add cross attention over the encoder's output."""

from __future__ import annotations

import math

import equinox as eqx
import jax

from .. import axes as X
from ..nn import Embedder, LayerNorm, LayerStack, transformer_stack
from ._trunk import Encoder, finish


class EncoderDecoder(eqx.Module):
    """A sequence-to-sequence Transformer: encoder, and a causal decoder with cross attention."""

    encoder: Encoder
    embed: Embedder
    decoder: LayerStack
    final_norm: LayerNorm | None
    head: jax.Array = X.param(X.EMBED, X.VOCAB)

    def __init__(self, target_vocab, dim, num_layers, num_heads, hidden, *, vocab_size=None,
                 input_dim=None, positions=None, max_len=512, block=None, stack=None, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.encoder = Encoder(dim, num_layers, num_heads, hidden, vocab_size=vocab_size,
                               input_dim=input_dim, positions=positions, max_len=max_len,
                               block=block, stack=stack, key=k1)
        self.embed = Embedder(dim, vocab_size=target_vocab, positions=positions, key=k2)
        dec_stack = dict(stack or {})
        if dec_stack.pop("reversible", False):
            raise ValueError("EncoderDecoder: reversible decoder blocks are not supported")
        self.decoder, self.final_norm = transformer_stack(
            dim, num_layers, num_heads, hidden, causal=True, cross=True, max_len=max_len,
            block=block, stack=dec_stack, key=k3)
        self.head = jax.random.normal(k4, (dim, target_vocab)) / math.sqrt(dim)

    def __call__(self, source, target, *, source_mask=None, target_mask=None, key=None):
        """Teacher-forced logits ``[B, Lt, target_vocab]``."""
        memory, source_mask = self.encoder(source, mask=source_mask, key=key)
        y, _ = self.embed(target, mask=target_mask, causal=True)
        h = self.decoder(y, kv_mask=target_mask, context=memory, context_mask=source_mask)
        h = finish(self.final_norm, h)
        return h @ self.head.astype(h.dtype)
