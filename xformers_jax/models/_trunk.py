"""The encoder trunk the classifiers, the dual encoder, the encoder-decoder and ELECTRA share:
an :class:`~xformers_jax.nn.Embedder`, a bidirectional :class:`~xformers_jax.nn.LayerStack`
(``nn.transformer_stack``) and the final norm of pre-LN blocks; and pooling.

Every model takes ``block`` (keyword arguments of ``nn.TransformerBlock``: ``spec``,
``placement``, ``norm``, ``activation``, ``position`` for q/k or bias schemes, ``ffn``,
``mixer``, ...) and ``stack`` (keyword arguments of ``nn.LayerStack``: ``remat``, ``sharing``,
``universal``, ``scan``, ``reversible``); ``positions`` is an input position scheme
(sinusoidal by default). Inputs are token ids ``int[B, L]`` or continuous features
``[B, L, F]`` (e.g. pixels).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..nn import Carry, Embedder, LayerNorm, LayerStack, transformer_stack


def finish(final, x):
    """``x`` through the final norm (pre-LN stacks), or ``x`` itself when there is none."""
    return x if final is None else final(x)


def run_with_aux(layers, x, state, **kw):
    """The stack run with a carry (``nn.Carry``: the ``eqx.nn.State`` of stateful attention
    when there is one): ``(y, state, aux)``, ``aux`` every layer's auxiliary outputs
    (``nn.aux_terms``)."""
    y, carry = layers(x, Carry(state=state), **kw)
    return y, carry.state, carry.aux


class Encoder(eqx.Module):
    """Embedder + bidirectional layer stack (+ final norm for pre-LN)."""

    embed: Embedder
    layers: LayerStack
    final_norm: LayerNorm | None

    def __init__(self, dim, num_layers, num_heads, hidden, *, vocab_size=None, input_dim=None,
                 cls_token=False, positions=None, max_len=512, block=None, stack=None, key):
        k1, k2 = jax.random.split(key)
        self.embed = Embedder(dim, vocab_size=vocab_size, input_dim=input_dim, cls_token=cls_token,
                              positions=positions, key=k1)
        self.layers, self.final_norm = transformer_stack(
            dim, num_layers, num_heads, hidden, causal=False, max_len=max_len, block=block,
            stack=stack, key=k2)

    def __call__(self, inputs, *, mask=None, key=None, state=None, inference=False,
                 return_aux=False):
        """Returns ``(hidden [B, L(+1), dim], mask)``, and the new ``state`` third when an
        ``eqx.nn.State`` is passed (stateful attention, e.g. routing); with ``return_aux`` the
        layers' auxiliary outputs (``nn.aux_terms``) come last. Token ids reach the layers
        (hash routing), the CLS position as ``nn.CLS_TOKEN_ID`` (0)."""
        x, mask = self.embed(inputs, mask=mask)
        h, new, aux = run_with_aux(self.layers, x, state, kv_mask=mask, key=key,
                                   inference=inference, tokens=self.embed.token_ids(inputs))
        h = finish(self.final_norm, h)
        out = (h, mask) if state is None else (h, mask, new)
        return (*out, aux) if return_aux else out


def pool(x, mask, pooling: str):
    """``"cls"``: the first position; ``"mean"``: the mean over real (unmasked) positions."""
    if pooling == "cls":
        return x[:, 0]
    w = jnp.ones(x.shape[:2], x.dtype) if mask is None else mask.astype(x.dtype)
    return jnp.einsum("bl,bld->bd", w, x) / jnp.maximum(w.sum(1, keepdims=True), 1)
