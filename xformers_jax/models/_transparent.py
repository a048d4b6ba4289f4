"""Transparent attention (Bapna et al., 2018, "Training Deeper Neural Machine Translation Models
with Transparent Attention").

The cross-attention of decoder layer ``j`` reads a learned combination of every encoder
layer's output, the embedding included (the survey's eq. 46):
``H~(j) = sum_{i=0}^{N} softmax_i(w_ij) H(i)``, one weight vector ``w[:, j]`` per decoder
layer. Every encoder layer then gets a short path to the loss. The stacks are pre-LN, so the
encoder's final LayerNorm is applied to each combination (to ``H(N)`` alone it is the plain
encoder-decoder's memory).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ._seq2seq import EncoderDecoder
from ._trunk import finish


def _scan_layers(stack, x, xs_extra, call):
    """Runs a (non-shared, non-reversible) :class:`LayerStack`'s blocks in order with per-layer
    extra inputs; returns ``(x, every layer's output [N, ...])``."""
    if stack.sharing != "none" or stack.reversible or stack.layerdrop or stack.universal:
        raise ValueError("TransparentEncoderDecoder: the stacks must be plain (sharing='none', "
                         "not reversible, universal or with layerdrop)")
    dynamic, static = stack.per_layer()

    def step(h, inputs):
        params, extra = inputs
        h = call(eqx.combine(params, static), h, extra)
        return h, h

    return jax.lax.scan(step, x, (dynamic, xs_extra))


class TransparentEncoderDecoder(eqx.Module):
    """An :class:`~xformers_jax.nn.EncoderDecoder` whose decoder layers attend to learned
    combinations of all encoder layers.

    Args: as :class:`EncoderDecoder` (``target_vocab, dim, num_layers, num_heads, hidden``,
    ``vocab_size`` or ``input_dim``, ``block``, ``stack``...). The combination weights
    ``weights [num_layers + 1, num_layers]`` (encoder layer ``i`` (0: the embedding), decoder
    layer ``j``) start at zero: a uniform average.

    Call: ``(source, target, source_mask=, target_mask=)`` -> logits ``[B, Lt, target_vocab]``.
    """

    model: EncoderDecoder
    weights: jax.Array

    def __init__(self, target_vocab, dim, num_layers, num_heads, hidden, *, key, **kwargs):
        self.model = EncoderDecoder(target_vocab, dim, num_layers, num_heads, hidden, key=key,
                                    **kwargs)
        self.weights = jnp.zeros((num_layers + 1, num_layers))

    def encoder_layers(self, source, *, source_mask=None):
        """Every encoder layer's output ``[N + 1, B, Ls, dim]`` (the embedding first)."""
        enc = self.model.encoder
        x, mask = enc.embed(source, mask=source_mask)
        n = enc.layers.num_layers
        _, hs = _scan_layers(enc.layers, x, jnp.zeros((n,)),
                             lambda block, h, _: block(h, kv_mask=mask))
        return jnp.concatenate([x[None], hs]), mask

    def __call__(self, source, target, *, source_mask=None, target_mask=None, key=None):
        m = self.model
        hs, source_mask = self.encoder_layers(source, source_mask=source_mask)
        if self.weights.shape != (hs.shape[0], m.decoder.num_layers):
            raise ValueError(f"TransparentEncoderDecoder: weights must be [N_enc + 1, N_dec] = "
                             f"[{hs.shape[0]}, {m.decoder.num_layers}], got {self.weights.shape}")
        alpha = jax.nn.softmax(self.weights.astype(jnp.float32), axis=0).astype(hs.dtype)
        contexts = jnp.einsum("ij,ibld->jbld", alpha, hs)
        contexts = finish(m.encoder.final_norm, contexts)
        y, _ = m.embed(target, mask=target_mask, causal=True)
        h, _ = _scan_layers(m.decoder, y, contexts, lambda block, h, c: block(
            h, kv_mask=target_mask, context=c, context_mask=source_mask))
        h = finish(m.final_norm, h)
        return h @ m.head.astype(h.dtype)
