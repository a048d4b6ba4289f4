"""Registry entries of the exact softmax kinds (:mod:`xformers_jax.attention._exact`,
:mod:`xformers_jax.attention._dense`): the only kinds that take additive position biases and
decode over a key/value cache."""

from __future__ import annotations

from ... import attention as A
from ...attention import patterns as P
from ...attention._kinds import KINDS
from .._registry import KVDecoding, Variant, WindowDecoding, lifted, register_variant

_KIND = {k.name: k for k in KINDS}
_EXACT_HP = frozenset({"block_q", "block_k", "implementation"})


def _block_sparse(q, k, v, *, pattern, **kw):
    return A.block_sparse_attention(q, k, v, pattern, **kw)


def _local(q, k, v, *, left, right=0, **kw):
    return A.block_sparse_attention(q, k, v, P.Local(left, right), **kw)


register_variant(Variant.from_kind(
    _KIND["dot_product"], lifted(A.dot_product_attention), hyperparameters={"pattern"},
    decoding=KVDecoding(pattern=lambda hp: hp.get("pattern")),
))
register_variant(Variant.from_kind(
    _KIND["flash"], lifted(A.flash_attention), hyperparameters=_EXACT_HP | {"pattern"},
    decoding=KVDecoding(pattern=lambda hp: hp.get("pattern")),
))
register_variant(Variant.from_kind(
    _KIND["block_sparse"], lifted(_block_sparse), hyperparameters=_EXACT_HP | {"pattern"},
    decoding=KVDecoding(pattern=lambda hp: hp["pattern"]),
))
register_variant(Variant.from_kind(
    _KIND["local"], lifted(_local), hyperparameters=_EXACT_HP | {"left", "right"},
    decoding=WindowDecoding(left=lambda hp: hp["left"]),
))
