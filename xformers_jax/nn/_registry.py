"""One registry of attention variants, so a model names its attention with a small spec.

An :class:`AttentionSpec` (``kind`` plus hyperparameters) is what configs hold. A
:class:`Variant` entry says how to run that kind inside
:class:`~xformers_jax.nn.MultiHeadAttention`: how to build its own parameters from a key, how to
call it on ``[batch, length, heads, dim]`` arrays, whether it supports ``causal`` and additive
position biases, and how it decodes (:class:`KVDecoding` for softmax-style attention,
:class:`WindowDecoding` for sliding-window eviction, :class:`RecurrentDecoding` for linear
attention, None when it cannot decode).

Entries are built from the metadata each attention family declares beside its functions
(:class:`xformers_jax.attention._kind.Kind`) plus the module-side adapters in
:mod:`._variants` (one module per family).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, final

from .. import attention as A
from ..attention._kind import Kind


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


@final
@dataclasses.dataclass(frozen=True)
class KVDecoding:
    """Decodes with a growing key/value cache and exact softmax over it.

    ``pattern(hp)`` gives the causal-safe sparse pattern whose row ``t`` masks the cache at step
    ``t`` (None, or a ``pattern`` returning None, for dense attention).
    """

    pattern: Callable[[Mapping], Any] | None = None
    name = "kv"

    def pattern_for(self, hp: Mapping):
        return None if self.pattern is None else self.pattern(hp)


@final
@dataclasses.dataclass(frozen=True)
class WindowDecoding:
    """Decodes with a ring buffer of the last keys: ``left(hp)`` keys before ``t`` are kept."""

    left: Callable[[Mapping], int]
    name = "window"


@final
@dataclasses.dataclass(frozen=True)
class RecurrentDecoding:
    """Decodes with a fixed-size state, as a recurrence.

    ``init_state(batch, heads, dk, dv, params, **hp)`` gives the ``[B, H, ...]`` state;
    ``step(state, q [B,H,Dk], k [B,Hkv,Dk], v [B,Hkv,Dv], params, **hp) -> (out [B,H,Dv],
    state)`` takes one token.
    """

    init_state: Callable
    step: Callable
    name = "recurrent"


Decoding = KVDecoding | WindowDecoding | RecurrentDecoding


@final
@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """How a kind runs with its sequence split over the active mesh's ``sequence`` axis.

    ``attend`` has :class:`Variant`'s ``attend`` signature and computes the same function with
    ``length`` sharded (ring attention, the halo exchange, the sequence-parallel scan: each
    lives with its family in :mod:`xformers_jax.attention`). ``check(hp, causal)`` returns
    None when these hyperparameters can run sharded, or the reason they cannot (a string).
    """

    attend: Callable
    check: Callable[[Mapping, bool], str | None] = lambda hp, causal: None


@final
@dataclasses.dataclass(frozen=True)
class Variant:
    """How :class:`MultiHeadAttention` runs one kind of attention.

    Attributes:
      name: the ``kind`` a spec uses.
      attend: ``attend(q [B,Lq,H,Dk], k [B,Lk,Hkv,Dk], v [B,Lk,Hkv,Dv], params, *, causal,
        kv_mask [B,Lk] | None, bias, key, q_mask [B,Lq] | None = None, **hp) -> [B,Lq,H,Dv]``;
        ``bias`` is a pytree callable whose leaves lead with ``[B, H]`` (see
        :mod:`._positions`) or None. ``q_mask`` marks the real queries (the padding mask in
        self-attention): a kind that computes statistics over queries must keep the others
        out of them (the contract, :mod:`xformers_jax.attention._contract`); the module zeros
        their outputs. It never sees the ``init_only`` hyperparameters.
      init: ``init(key, hp, *, num_heads, head_dim, max_len) -> pytree | None``: the variant's
        own trainable arrays (e.g. Linformer's projections); it sees every hyperparameter.
      causal: whether ``causal=True`` is supported (otherwise the module raises).
      bias: whether additive score biases (ALiBi, T5, Shaw, ...) are supported.
      decoding: a :class:`KVDecoding`, :class:`WindowDecoding`, :class:`RecurrentDecoding`, or
        None (cannot decode).
      hyperparameters: the names a spec may give (others are rejected when the spec is used).
      init_only: those of ``hyperparameters`` that only shape the parameters (Linformer's
        ``proj_len``): ``init`` reads them, ``attend`` and decoding never see them.
      takes_input: ``attend`` also receives ``inputs`` (the block input ``[B, L, dim]``) and
        ``init`` receives ``dim`` (e.g. Longformer's global projections).
      state: ``state(key, hp, *, num_heads, head_dim) -> pytree`` or None: the initial value of
        the variant's non-gradient state (an ``eqx.nn.StateIndex`` of the module). ``attend``
        then also receives ``state`` (the current value) and ``inference`` and returns
        ``(out, new_state)``.
      layer_carry: ``layer_carry(batch, lq, lk, hp, *, num_heads, head_dim, num_layers) ->
        pytree`` or None: for kinds that pass scores from one layer to the next (Realformer,
        Predictive attention, Lazyformer), the first layer's carry; ``attend`` then also
        receives ``carry`` and returns ``(out, new_carry)``, and a
        :class:`~xformers_jax.nn.LayerStack` threads it through its layers.
      dense_scores: the kind needs the previous layer's ``[Lq, Lk]`` attention map itself
        (Predictive attention, Lazyformer), which no tiled kernel forms.
      sequence: a :class:`SequenceParallel` when the kind can run with ``length`` split over
        devices (the ``sequence`` strategy), else None (a model that needs it raises when it
        is built for such a mesh).
      metadata: the kind's :class:`~xformers_jax.attention._kind.Kind` record (paper,
        complexity, test hyperparameters), or None for a variant registered outside the
        library.
    """

    name: str
    attend: Callable
    init: Callable = _no_params
    causal: bool = True
    bias: bool = False
    decoding: Decoding | None = None
    hyperparameters: frozenset = frozenset()
    init_only: frozenset = frozenset()
    takes_input: bool = False
    state: Callable | None = None
    layer_carry: Callable | None = None
    dense_scores: bool = False
    sequence: SequenceParallel | None = None
    metadata: Kind | None = None

    def __init_subclass__(cls, **kwargs):
        raise TypeError("Variant is final: give a kind its module-side needs with the fields "
                        "takes_input, state, layer_carry and decoding, not with a subclass")

    def __post_init__(self):
        object.__setattr__(self, "hyperparameters", frozenset(self.hyperparameters))
        object.__setattr__(self, "init_only", frozenset(self.init_only))
        if not self.init_only <= self.hyperparameters:
            raise ValueError(f"Variant {self.name!r}: init_only {sorted(self.init_only)} must be "
                             f"among its hyperparameters {sorted(self.hyperparameters)}")
        if self.state is not None and self.layer_carry is not None:
            raise ValueError(f"Variant {self.name!r}: a kind keeps eqx.nn.State or a carry "
                             "between layers, not both")
        if self.decoding is not None and not isinstance(
                self.decoding, (KVDecoding, WindowDecoding, RecurrentDecoding)):
            raise ValueError(f"Variant {self.name!r}: decoding must be a KVDecoding, "
                             f"WindowDecoding, RecurrentDecoding or None, got {self.decoding!r}")

    @classmethod
    def from_kind(cls, kind: Kind, attend: Callable, **fields) -> "Variant":
        """The entry for a kind declared in :mod:`xformers_jax.attention`: ``name``,
        ``causal`` and ``bias`` come from its record, and the decoding object must match the
        record's decoding mode."""
        v = cls(kind.name, attend, causal=kind.causal, bias=kind.bias, metadata=kind, **fields)
        mode = None if v.decoding is None else v.decoding.name
        if mode != kind.decoding:
            raise ValueError(f"Variant {kind.name!r}: decoding {mode!r} but its Kind record "
                             f"declares {kind.decoding!r}")
        return v

    def sequence_problem(self, hp: Mapping, *, causal: bool) -> str | None:
        """Why this kind with ``hp`` cannot run with its sequence split, or None if it can."""
        if self.sequence is None:
            return (f"attention kind {self.name!r} has no sequence-parallel form (kinds that "
                    "have one: " + ", ".join(
                        n for n, v in sorted(_REGISTRY.items()) if v.sequence) + ")")
        reason = self.sequence.check(hp, causal)
        return None if reason is None else f"attention kind {self.name!r}: {reason}"

    def attend_for(self, sequence_shards: int, hp: Mapping, *, causal: bool) -> Callable:
        """``attend``, or the sequence-parallel form when the active mesh splits the sequence
        (``sequence_shards > 1``); raises ``NotImplementedError`` when the kind cannot."""
        if sequence_shards == 1:
            return self.attend
        problem = self.sequence_problem(hp, causal=causal)
        if problem is not None:
            raise NotImplementedError(f"{problem}; the active mesh splits the sequence over "
                                      f"{sequence_shards} devices")
        return self.sequence.attend

    def call_hyperparameters(self, hp: Mapping) -> dict:
        """``hp`` without the ``init_only`` names: what ``attend`` and decoding receive."""
        return {n: val for n, val in hp.items() if n not in self.init_only}

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


def register_variant(variant: Variant, *, replace: bool = False) -> Variant:
    """Adds a registry entry and returns it; a name already registered raises ValueError
    unless ``replace=True``."""
    if variant.name in _REGISTRY and not replace:
        raise ValueError(f"attention kind {variant.name!r} is already registered; pass "
                         "replace=True to replace it")
    _REGISTRY[variant.name] = variant
    return variant


def get_variant(kind: str) -> Variant:
    if kind not in _REGISTRY:
        raise ValueError(f"unknown attention kind {kind!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[kind]


def registered_variants() -> tuple[str, ...]:
    """Names of every registered attention kind."""
    return tuple(sorted(_REGISTRY))


def lifted(fn: Callable, arg_axes=(), kwarg_axes=None, *, unpack: bool = False,
           takes_q_mask: bool = False) -> Callable:
    """An ``attend`` for a one-head function of the contract, lifted with ``multihead``.

    ``params`` (if not None) is passed as one extra positional argument laid out per
    ``arg_axes`` (with ``unpack=True``, a tuple of them); a bias pytree is mapped over
    ``[batch, heads]``. Grouped-query heads are multihead's: no key/value head is copied.
    ``takes_q_mask``: ``fn`` computes statistics over queries and takes the contract's
    ``q_mask`` (split over the batch); other functions compute each query's output from that
    query alone, so a padded query cannot reach a real output and ``q_mask`` is not passed.
    """
    kw_axes = {"bias": "batch_heads", **(kwarg_axes or {})}

    def attend(q, k, v, params, *, causal, kv_mask, bias, key, q_mask=None, **hp):
        extra = () if params is None else tuple(params) if unpack else (params,)
        axes = tuple(arg_axes) * len(extra) if unpack else tuple(arg_axes)[: len(extra)]
        kw = {} if bias is None else {"bias": bias}
        if takes_q_mask:
            kw["q_mask"] = q_mask
        f = A.multihead(fn, arg_axes=axes, kwarg_axes=kw_axes)
        return f(q, k, v, *extra, causal=causal, kv_mask=kv_mask, key=key, **kw, **hp)

    return attend


# Every family registers here, so any import of the registry sees every kind (the default
# AttentionSpec names "dot_product").
from . import _variants  # noqa: E402,F401
