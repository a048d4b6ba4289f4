"""What flows through a block or a layer stack besides the activations, as one small pytree.

A block or a stack is called ``layer(x, **inputs) -> y`` when it carries nothing, or
``layer(x, carry, **inputs) -> (y, carry)`` (Equinox's optional-state convention, with one
:class:`Carry` in place of the state): the carry brings what the call reads and takes back
what it changed, so a stack threads it through its layers without knowing what is in it
(Haliax's ``Stacked``: the block owns its carry).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Carry(NamedTuple):
    """The carried part of a block's or a stack's call.

    A ``NamedTuple`` (a pytree; a plain tuple, so that it may hold an ``eqx.nn.State`` that a
    call has just replaced).

    Attributes:
      state: the model's ``eqx.nn.State`` (stateful attention, e.g. routing centroids;
        stateful norms, PowerNorm), or None. Comes back updated.
      memory: the block memory (``nn.MemoryState``; a stack: every layer's, on a leading layer
        axis), or None. Comes back as the memory after this segment.
      scores: the scores the previous layer passed on, for attention kinds that pass them
        from layer to layer (Realformer, Predictive attention, Lazyformer), or None (a stack
        starts them itself). Comes back as this layer's.
      aux: the auxiliary outputs of the call (the FFN slot's: router losses, tokens dropped,
        expert load; a stack's on a leading layer axis). Written by the call.
    """

    state: Any = None
    memory: Any = None
    scores: Any = None
    aux: dict = {}  # never mutated: a call writes a new dict

    def replace(self, **changes) -> "Carry":
        """This carry with the given fields replaced."""
        return self._replace(**changes)
