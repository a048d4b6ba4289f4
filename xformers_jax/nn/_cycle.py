"""An FFN kind in every n-th layer: GLaM's setting (Du et al., 2022, "GLaM: Efficient Scaling
of Language Models with Mixture-of-Experts": a mixture-of-experts FFN in every other layer, the
dense FFN in the others; also GShard's and Switch's "every other layer" placements).

``FFNSpec(kind, params, every=n)`` in a model's ``block`` makes layers ``n-1, 2n-1, ...`` use
the kind and the others the dense FFN. A ``LayerStack`` scans identical units, so the models'
stack scans :class:`BlockCycle` units of ``n`` blocks (``n - 1`` dense, then the kind's) over
``num_layers / n`` steps; the stack's ``num_layers`` counts units. Each unit's auxiliary outputs
are its sparse block's, so the stack's ``aux`` has one row per sparse layer and the losses are
still summed per layer (``nn.aux_terms``).
"""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from ._blocks import TransformerBlock
from ._carry import Carry
from ._norms import LayerNorm
from ._slots import FFNSpec
from ._stack import LayerStack


class BlockCycle(eqx.Module):
    """Blocks applied in order as one unit of a ``LayerStack``; block ``i`` of a training
    call gets ``fold_in(key, i)``. Supports the block call (a carried call merges the blocks'
    auxiliary outputs), ``init_cache`` and ``decode``; no ``eqx.nn.State`` and no memory."""

    blocks: tuple

    def __init__(self, blocks):
        self.blocks = tuple(blocks)

    def __call__(self, x, carry: Carry | None = None, *, key=None, **kw):
        if carry is not None and (carry.state is not None or carry.memory is not None):
            raise ValueError("BlockCycle: stateful layers and memories are not supported in a "
                             "cycle of blocks (FFNSpec(every=n))")
        aux = {}
        c = Carry() if carry is None else carry
        for i, block in enumerate(self.blocks):
            k = None if key is None else jax.random.fold_in(key, i)
            x, c = block(x, c, key=k, **kw)
            aux.update(c.aux)
        return x if carry is None else (x, c.replace(aux=aux))

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        return tuple(b.init_cache(batch, max_len, dtype) for b in self.blocks)

    def decode(self, x, cache, *, tokens=None, context=None, context_mask=None):
        new = []
        for block, c in zip(self.blocks, cache):
            x, c = block.decode(x, c, tokens=tokens, context=context, context_mask=context_mask)
            new.append(c)
        return x, tuple(new)


def cycle_blocks(make_block, ffn: FFNSpec | None, num_layers: int):
    """``(make_unit, units)`` for a stack of ``num_layers`` blocks made by ``make_block(ffn=...,
    key=...)``: the block itself and ``num_layers`` when ``ffn.every`` is 1, otherwise
    :class:`BlockCycle` units of ``every`` blocks (``every - 1`` dense, then ``ffn``)."""
    every = 1 if ffn is None else ffn.every
    if every == 1:
        return make_block, num_layers
    if num_layers % every:
        raise ValueError(f"FFNSpec(every={every}): num_layers={num_layers} is not a multiple "
                         f"of {every}")
    sparse = dataclasses.replace(ffn, every=1)

    def make_unit(*, key):
        keys = jax.random.split(key, every)
        return BlockCycle([make_block(ffn=FFNSpec() if i < every - 1 else sparse, key=k)
                           for i, k in enumerate(keys)])

    return make_unit, num_layers // every


def transformer_stack(dim: int, num_layers: int, num_heads: int, hidden: int, *, causal: bool,
                      cross: bool = False, max_len: int = 512, block=None, stack=None, key):
    """The trunk every model builds: a :class:`LayerStack` of ``num_layers``
    :class:`TransformerBlock` s (``block``: the blocks' keyword arguments, ``spec``, ``ffn``,
    ``mixer``, ``placement``, ...; ``stack``: the stack's, ``remat``, ``sharing``, ...), in
    :class:`BlockCycle` units when ``block["ffn"]`` places its kind in every n-th layer, and
    the final norm pre-LN blocks need (None for other placements). Returns ``(stack,
    final_norm)``."""
    block = dict(block or {})
    make = functools.partial(TransformerBlock, dim, num_heads, hidden, causal=causal,
                             cross=cross, max_len=max_len, **block)
    # FFNSpec(every=n): units of n blocks, the FFN kind in the last (GLaM's every other layer).
    make, units = cycle_blocks(make, block.get("ffn"), num_layers)
    final = LayerNorm(dim) if block.get("placement", "pre") == "pre" else None
    return LayerStack(lambda k: make(key=k), units, key=key, **(stack or {})), final
