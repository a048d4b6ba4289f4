"""One registry of attention variants, so a model names its attention with a small spec.

An :class:`AttentionSpec` (``kind`` plus hyperparameters) is what configs hold. A
:class:`Variant` entry says how to run that kind inside
:class:`~xformers_jax.nn.MultiHeadAttention`: how to build its own parameters from a key, how to
call it on ``[batch, length, heads, dim]`` arrays, whether it supports ``causal`` and additive
position biases, and which decoding cache it uses (``"kv"`` for softmax-style attention,
``"window"`` for sliding-window eviction, ``"recurrent"`` for linear attention, ``None`` when it
cannot decode).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from .. import attention as A
from ..attention import patterns as P


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Names an attention variant and its static hyperparameters (hashable, config friendly).

    Example: ``AttentionSpec("block_sparse", {"pattern": Local(16, 0)})`` or
    ``AttentionSpec.from_config({"kind": "flash", "block_q": 128})``.
    """

    kind: str = "dot_product"
    params: Any = ()

    def __post_init__(self):
        items = self.params.items() if isinstance(self.params, Mapping) else self.params
        object.__setattr__(self, "params", tuple(sorted(dict(items).items())))
        get_variant(self.kind)

    @property
    def hyperparameters(self) -> dict:
        return dict(self.params)

    @classmethod
    def from_config(cls, config: Mapping) -> "AttentionSpec":
        """Builds a spec from a mapping with a ``kind`` key; every other key is a hyperparameter."""
        config = dict(config)
        if "kind" not in config:
            raise ValueError(f"AttentionSpec.from_config: missing 'kind' in {sorted(config)}")
        kind = config.pop("kind")
        return cls(kind, config)


def _no_params(key, hp, *, num_heads, head_dim, max_len):
    return None


@dataclasses.dataclass(frozen=True)
class Variant:
    """How :class:`MultiHeadAttention` runs one kind of attention.

    Attributes:
      name: the ``kind`` a spec uses.
      attend: ``attend(q [B,Lq,H,Dk], k [B,Lk,Hkv,Dk], v [B,Lk,Hkv,Dv], params, *, causal,
        kv_mask [B,Lk] | None, bias, key, **hp) -> [B,Lq,H,Dv]``; ``bias`` is a pytree callable
        whose leaves lead with ``[B, H]`` (see :mod:`._positions`) or None.
      init: ``init(key, hp, *, num_heads, head_dim, max_len) -> pytree | None``: the variant's
        own trainable arrays (e.g. Linformer's projections).
      causal: whether ``causal=True`` is supported (otherwise the module raises).
      bias: whether additive score biases (ALiBi, T5, Shaw, ...) are supported.
      cache: ``"kv"``, ``"window"``, ``"recurrent"`` or None (cannot decode).
      hyperparameters: the names ``attend`` accepts (others are rejected when the spec is used).
      window: for ``cache="window"``, ``window(hp) -> left`` (keys ``t-left..t`` are kept).
      init_state / step: for ``cache="recurrent"``: ``init_state(batch, heads, dk, dv, params,
        **hp)`` and ``step(state, q [B,H,Dk], k [B,Hkv,Dk], v [B,Hkv,Dv], params, **hp) ->
        (out [B,H,Dv], state)``.
      decode_pattern: for ``cache="kv"`` with a sparse pattern, ``decode_pattern(hp)`` gives
        the causal-safe pattern whose row ``t`` masks the cache.
    """

    name: str
    attend: Callable
    init: Callable = _no_params
    causal: bool = True
    bias: bool = False
    cache: str | None = None
    hyperparameters: frozenset = frozenset()
    window: Callable | None = None
    init_state: Callable | None = None
    step: Callable | None = None
    decode_pattern: Callable | None = None

    def check(self, hp: Mapping, *, causal: bool):
        unknown = set(hp) - set(self.hyperparameters)
        if unknown:
            raise ValueError(
                f"attention kind {self.name!r}: unknown hyperparameters {sorted(unknown)}; it "
                f"accepts {sorted(self.hyperparameters)}"
            )
        if causal and not self.causal:
            raise NotImplementedError(
                f"attention kind {self.name!r} does not support causal=True (its method mixes "
                "information from future positions)"
            )


_REGISTRY: dict[str, Variant] = {}


def register_variant(variant: Variant) -> Variant:
    """Adds (or replaces) a registry entry; returns it."""
    _REGISTRY[variant.name] = variant
    return variant


def get_variant(kind: str) -> Variant:
    if kind not in _REGISTRY:
        raise ValueError(f"unknown attention kind {kind!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[kind]


def registered_variants() -> tuple[str, ...]:
    """Names of every registered attention kind."""
    return tuple(sorted(_REGISTRY))


def lifted(fn: Callable, arg_axes=(), kwarg_axes=None) -> Callable:
    """An ``attend`` for a one-head function of the contract, lifted with ``multihead``.

    ``params`` (if not None) is passed as one extra positional argument laid out per
    ``arg_axes``; a bias pytree is mapped over ``[batch, heads]``.
    """
    kw_axes = {"bias": "batch_heads", **(kwarg_axes or {})}

    def attend(q, k, v, params, *, causal, kv_mask, bias, key, **hp):
        extra = () if params is None else (params,)
        kw = {} if bias is None else {"bias": bias}
        f = A.multihead(fn, arg_axes=tuple(arg_axes)[: len(extra)], kwarg_axes=kw_axes)
        return f(q, k, v, *extra, causal=causal, kv_mask=kv_mask, key=key, **kw, **hp)

    return attend


def _block_sparse(q, k, v, *, pattern, **kw):
    return A.block_sparse_attention(q, k, v, pattern, **kw)


def _local(q, k, v, *, left, right=0, **kw):
    return A.block_sparse_attention(q, k, v, P.Local(left, right), **kw)


_EXACT_HP = frozenset({"block_q", "block_k", "implementation"})

register_variant(Variant(
    "dot_product", lifted(A.dot_product_attention), bias=True, cache="kv",
    hyperparameters=frozenset({"pattern"}), decode_pattern=lambda hp: hp.get("pattern"),
))
register_variant(Variant(
    "flash", lifted(A.flash_attention), bias=True, cache="kv",
    hyperparameters=_EXACT_HP | {"pattern"}, decode_pattern=lambda hp: hp.get("pattern"),
))
register_variant(Variant(
    "block_sparse", lifted(_block_sparse), bias=True, cache="kv",
    hyperparameters=_EXACT_HP | {"pattern"}, decode_pattern=lambda hp: hp["pattern"],
))
register_variant(Variant(
    "local", lifted(_local), bias=True, cache="window",
    hyperparameters=_EXACT_HP | {"left", "right"}, window=lambda hp: hp["left"],
))

