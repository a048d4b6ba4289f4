"""Registry entries of the exact softmax kinds (:mod:`xformers_jax.attention._exact`,
:mod:`xformers_jax.attention._dense`): the only kinds that take additive position biases and
decode over a key/value cache."""

from __future__ import annotations

from ... import attention as A
from ...attention import patterns as P
from ...attention._kinds import KINDS
from .._registry import (KVDecoding, SequenceParallel, Variant, WindowDecoding, lifted,
                         register_variant)

_KIND = {k.name: k for k in KINDS}
_EXACT_HP = frozenset({"block_q", "block_k", "implementation"})


def _block_sparse(q, k, v, *, pattern, **kw):
    return A.block_sparse_attention(q, k, v, pattern, **kw)


def _local(q, k, v, *, left, right=0, **kw):
    return A.block_sparse_attention(q, k, v, P.Local(left, right), **kw)


# Sequence parallelism: ring attention (Liu et al., 2023) for the full and causal patterns, a
# halo exchange for the sliding window. The Pallas implementations are single-device kernels:
# under a sequence split the ring runs the XLA tiles.
def _ring(q, k, v, *, causal=False, kv_mask=None, key=None, block_q=None, block_k=None,
          pattern=None, implementation=None):
    return A.ring_attention(q, k, v, causal=causal, kv_mask=kv_mask, block_q=block_q,
                            block_k=block_k)


def _halo(q, k, v, *, left, right=0, causal=False, kv_mask=None, key=None, block_q=None,
          block_k=None, implementation=None):
    return A.halo_local_attention(q, k, v, left=left, right=right, causal=causal,
                                  kv_mask=kv_mask, block_q=block_q, block_k=block_k)


def _no_pattern(hp, causal):
    if hp.get("pattern") is not None:
        return ("ring attention runs the full or causal pattern, not pattern="
                f"{hp['pattern']!r}; use kind 'local' for a sliding window")
    return None


_RING = SequenceParallel(lifted(_ring), _no_pattern)

register_variant(Variant.from_kind(
    _KIND["dot_product"], lifted(A.dot_product_attention), hyperparameters={"pattern"},
    decoding=KVDecoding(pattern=lambda hp: hp.get("pattern")), sequence=_RING,
))
register_variant(Variant.from_kind(
    _KIND["flash"], lifted(A.flash_attention), hyperparameters=_EXACT_HP | {"pattern"},
    decoding=KVDecoding(pattern=lambda hp: hp.get("pattern")), sequence=_RING,
))
register_variant(Variant.from_kind(
    _KIND["block_sparse"], lifted(_block_sparse), hyperparameters=_EXACT_HP | {"pattern"},
    decoding=KVDecoding(pattern=lambda hp: hp["pattern"]),
))
register_variant(Variant.from_kind(
    _KIND["local"], lifted(_local), hyperparameters=_EXACT_HP | {"left", "right"},
    decoding=WindowDecoding(left=lambda hp: hp["left"]), sequence=SequenceParallel(lifted(_halo)),
))
