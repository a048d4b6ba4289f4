"""A mask function as a pattern: flex attention's ``mask_mod`` (Dong et al., 2024, "Flex
Attention: A Programming Model for Generating Optimized Attention Kernels").

``MaskMod(fn)`` wraps a pure JAX function ``fn(b, h, q_idx, kv_idx) -> bool`` (PyTorch
FlexAttention's signature) so it is a :class:`~._base.Pattern` like any other: it combines
with patterns and other mask functions through ``|`` and ``&``, and its
:class:`~xformers_jax.kernels.BlockLayout` (empty, partial and full tiles) is derived by
evaluating ``fn`` on the host once per ``(mask, lq, lk, block_q, block_k)`` and cached
(``_base._layout``'s cache). The cache key of a ``MaskMod`` is its ``key``: by default the
function object itself (so a new closure is a new entry, and a captured numpy array changed in
place after the first call is not seen); :func:`document_mask` keys on its ids' contents.

A static layout needs a mask that is known on the host: ``fn`` must not capture traced arrays
(made inside ``jit``/``grad``/``vmap``) nor depend on ``b`` or ``h`` (one layout serves every
batch row and head). Such a mask is *dynamic* (:meth:`MaskMod.is_static` is False):
``flex_attention`` evaluates it inside each listed tile as data, over the layout of the static
patterns it is intersected with (``Causal() & MaskMod(doc)``: the causal tiles, the document
mask in-tile), or over every tile when nothing static bounds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._base import Intersection, Pattern, Union


@dataclasses.dataclass(frozen=True, eq=False)
class MaskMod(Pattern):
    """A mask function ``fn(b, h, q_idx, kv_idx) -> bool`` as a pattern.

    ``fn`` is called with int32 scalars ``b``, ``h`` and broadcastable int32 position arrays
    (``q_idx [n, 1]``, ``kv_idx [1, m]``), so it is written elementwise with ``jnp``
    operations, as for PyTorch's ``mask_mod`` (there vmapped over scalars). Positions past the
    sequence ends can occur inside a tile (they are masked anyway): index captured arrays with
    ``jnp`` (out-of-range reads clamp), never with numpy.

    Attributes:
      fn: the mask function.
      key: the cache key (equality and hash); None: the function object itself.
      causal_safe: the caller's promise that no query sees a later key (enables decoding).
    """

    fn: Callable[..., Any]
    key: Hashable = None
    causal_safe: bool = False

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"MaskMod: fn must be a callable (b, h, q_idx, kv_idx) -> bool, "
                            f"got {type(self.fn).__name__}")

    @property
    def _key(self):
        return self.fn if self.key is None else self.key

    def __eq__(self, other):
        return isinstance(other, MaskMod) and self._key == other._key

    def __hash__(self):
        return hash(("MaskMod", self._key))

    def is_static(self) -> bool:
        """True when the mask is known on the host: ``fn`` captures no traced array and reads
        neither ``b`` nor ``h``, so a block layout can be derived from it."""
        scalar = jnp.zeros((), jnp.int32)
        closed = jax.make_jaxpr(self.fn)(scalar, scalar, jnp.zeros((2, 1), jnp.int32),
                                         jnp.zeros((1, 2), jnp.int32))
        if any(isinstance(c, jax.core.Tracer) for c in closed.consts):
            return False
        jaxpr = closed.jaxpr
        b, h = jaxpr.invars[:2]
        used = {id(x) for e in jaxpr.eqns for x in e.invars} | {id(x) for x in jaxpr.outvars}
        return id(b) not in used and id(h) not in used

    def mask(self, i, j, lq, lk):
        # Evaluated eagerly (also while an enclosing jit traces the caller), compiled once
        # per shape: layouts ask for one tile at a time.
        with jax.ensure_compile_time_eval():
            out = _evaluate(self.fn, jnp.asarray(i, jnp.int32), jnp.asarray(j, jnp.int32))
        if isinstance(out, jax.core.Tracer):
            raise ValueError(f"{self!r} depends on traced values; it has no static layout "
                             "(flex_attention evaluates such a mask in-tile)")
        return np.broadcast_to(np.asarray(out, bool), np.broadcast_shapes(np.shape(i), np.shape(j)))

    def __or__(self, other):
        if isinstance(other, MaskMod):  # one function: a union with a dynamic part stays whole
            return MaskMod(lambda *a: self.fn(*a) | other.fn(*a), ("|", self._key, other._key),
                           self.causal_safe and other.causal_safe)
        return Union((self, other))

    def __and__(self, other):
        return Intersection((self, other))

    def __repr__(self):
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return f"MaskMod({name})" if self.key is None else f"MaskMod(key={self.key!r:.60})"


_COMPILED: dict = {}


def _evaluate(fn, i, j):
    """``fn`` at ``b = h = 0`` under ``jax.jit`` (one compilation per function and shape)."""
    f = _COMPILED.get(fn)
    if f is None:
        f = jax.jit(lambda i, j: fn(jnp.int32(0), jnp.int32(0), i, j))
        if len(_COMPILED) > 256:
            _COMPILED.clear()
        _COMPILED[fn] = f
    return f(i, j)


def document_mask(ids) -> MaskMod:
    """Attention within documents: ``ids[q_idx] == ids[kv_idx]`` for ``ids int[L]`` (packed
    sequences, one document id per position; self-attention).

    Concrete ids (numpy, or a jax array made outside ``jit``) give a static layout, keyed on
    their contents: tiles between different documents are never computed. Traced ids are
    evaluated in-tile as data (for those the kernel's ``segment_ids`` argument does the same).
    """
    if isinstance(ids, jax.core.Tracer):
        arr = ids
        key = None
    else:
        host = np.asarray(ids)
        if host.ndim != 1 or not np.issubdtype(host.dtype, np.integer):
            raise ValueError(f"document_mask: ids must be int[L], got {host.dtype}{host.shape}")
        arr = jnp.asarray(host, jnp.int32)
        key = ("document", host.shape, host.astype(np.int64).tobytes())

    def same_document(b, h, q_idx, kv_idx):
        return arr[q_idx] == arr[kv_idx]

    return MaskMod(same_document, key, causal_safe=False)
