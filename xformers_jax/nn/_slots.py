"""The one slot registry: attention kinds, token mixers and FFN kinds, each named by a spec.

A block fills three slots by name: its attention (:class:`AttentionSpec`, run by
:class:`~xformers_jax.nn.MultiHeadAttention`), the token mixer that may replace it
(:class:`MixerSpec`) and its FFN (:class:`FFNSpec`). Every kind of every slot is one
:class:`xformers_jax.kinds.Kind` record, declared beside its function
(``xformers_jax.attention.KINDS``, ``xformers_jax.mixers.KINDS``, ``xformers_jax.experts.KINDS``)
and registered here when this module is imported; nothing it imports imports it back.

A spec holds a kind's name and the hyperparameters a config gives (hashable, so it can be a
static field); it checks the kind and the names when it is made, and :attr:`Spec.resolved`
fills in every declared default: what the kind's adapter or layer receives, so the declared
defaults are the ones in effect. A mixer or FFN kind's layer is attached where the layer is
defined, with :func:`implements`; an attention kind's :class:`~xformers_jax.kinds.AttentionAdapter`
comes with its record.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

from .. import attention, experts, mixers
from ..kinds import NOUNS, SLOTS, Kind

_REGISTRY: dict[str, dict[str, Kind]] = {slot: {} for slot in SLOTS}

# What a slot raises for a kind without a causal form, in a causal model (one table, the
# wording each slot has always used).
_NOT_CAUSAL = {
    "attention": (NotImplementedError, "attention kind {name!r} does not support causal=True "
                  "(its method mixes information from future positions)"),
    "mixer": (NotImplementedError, "mixer {name!r} has no causal form (it mixes information "
              "from future positions)"),
    "ffn": (ValueError, "FFN kind {name!r} is not causal-safe (a token's output would depend "
            "on later tokens); use it in a bidirectional model"),
}


def _table(slot: str) -> dict[str, Kind]:
    if slot not in _REGISTRY:
        raise ValueError(f"unknown slot {slot!r}; the slots are {SLOTS}")
    return _REGISTRY[slot]


def register_kind(kind: Kind, *, replace: bool = False) -> Kind:
    """Adds ``kind`` to its slot's registry and returns it; a name already registered in that
    slot raises ValueError unless ``replace=True``."""
    if not isinstance(kind, Kind):
        raise TypeError(f"register_kind takes a xformers_jax.kinds.Kind, got {kind!r}")
    table = _table(kind.slot)
    if kind.name in table and not replace:
        raise ValueError(f"{NOUNS[kind.slot]} {kind.name!r} is already registered; pass "
                         "replace=True to replace it")
    table[kind.name] = kind
    return kind


def get_kind(slot: str, name: str) -> Kind:
    """The registered record of ``name`` in ``slot`` (``"attention"``, ``"mixer"``, ``"ffn"``)."""
    table = _table(slot)
    if name not in table:
        raise ValueError(f"unknown {NOUNS[slot]} {name!r}; registered: {sorted(table)}")
    return table[name]


def registered_kinds(slot: str) -> tuple[str, ...]:
    """Names of every kind registered in ``slot``, sorted."""
    return tuple(sorted(_table(slot)))


def implements(*names: str):
    """Class decorator: the decorated layer is the adapter of the mixer or FFN kinds
    ``names`` (``@implements("switch", "gshard")`` on ``MoEFeedForward``), so a kind's layer is
    declared beside the layer and its metadata beside its function."""
    def attach(layer):
        for name in names:
            slots = [s for s in ("mixer", "ffn") if name in _REGISTRY[s]]
            if len(slots) != 1:
                raise ValueError(f"implements({name!r}) on {layer.__name__}: the name must be one "
                                 f"registered mixer or FFN kind, found in {slots or 'neither'}")
            kind = _REGISTRY[slots[0]][name]
            register_kind(dataclasses.replace(kind, adapter=layer), replace=True)
        return layer
    return attach


def check_causal(kind: Kind, causal: bool) -> None:
    """Raises the slot's error when ``causal`` and ``kind`` has no causal form."""
    if causal and not kind.causal:
        error, message = _NOT_CAUSAL[kind.slot]
        raise error(message.format(name=kind.name))


def _build_layer(kind: Kind, dim: int, size: int, hp: Mapping, *, causal: bool, key, **block):
    """The mixer or FFN layer of ``kind``: ``layer(dim, size, *, causal, key, **block,
    **layer_arguments, **hp)`` (``size``: heads or hidden width; ``block``: ``max_len`` or
    ``activation``)."""
    if kind.adapter is None:
        raise ValueError(f"{NOUNS[kind.slot]} {kind.name!r} has no layer: decorate one with "
                         f"nn.implements({kind.name!r})")
    return kind.adapter(dim, size, causal=causal, key=key, **block, **kind.layer_arguments,
                        **hp)


def sequence_problem(kind: Kind, hp: Mapping, *, causal: bool) -> str | None:
    """Why attention kind ``kind`` with (resolved) ``hp`` cannot run with its sequence split,
    or None if it can."""
    sequence = kind.adapter.sequence
    if sequence is None:
        return (f"attention kind {kind.name!r} has no sequence-parallel form (kinds that have "
                "one: " + ", ".join(n for n, k in sorted(_REGISTRY["attention"].items())
                                    if k.adapter is not None and k.adapter.sequence) + ")")
    reason = sequence.check(hp, causal)
    return None if reason is None else f"attention kind {kind.name!r}: {reason}"


# -- specs ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Spec:
    """Names a kind of one slot and its hyperparameters (hashable, config friendly). A
    subclass fixes the slot: :class:`AttentionSpec`, :class:`MixerSpec`, :class:`FFNSpec`.

    The kind and the hyperparameter names are checked when the spec is made (an unknown one
    raises ``ValueError`` with the accepted names); a missing required one when it is used
    (:attr:`resolved`).
    """

    kind: str
    params: Any = ()
    slot: ClassVar[str]

    def __post_init__(self):
        if not hasattr(type(self), "slot"):
            raise TypeError("Spec names no slot: use AttentionSpec, MixerSpec or FFNSpec")
        items = self.params.items() if isinstance(self.params, Mapping) else self.params
        object.__setattr__(self, "params", tuple(sorted(dict(items).items())))
        self.record.check_names(self.params)

    @property
    def record(self) -> Kind:
        """The kind's registered :class:`~xformers_jax.kinds.Kind`."""
        return get_kind(self.slot, self.kind)

    @property
    def hyperparameters(self) -> dict:
        """The hyperparameters the spec gives."""
        return dict(self.params)

    @property
    def resolved(self) -> dict:
        """The hyperparameters with every declared default filled in (``Kind.resolve``)."""
        return self.record.resolve(self.params)

    @classmethod
    def from_config(cls, config: Mapping) -> "Spec":
        """Builds a spec from a mapping with a ``kind`` key; every other key is a
        hyperparameter."""
        config = dict(config)
        if "kind" not in config:
            raise ValueError(f"{cls.__name__}.from_config: missing 'kind' in {sorted(config)}")
        return cls(config.pop("kind"), config)


@dataclasses.dataclass(frozen=True)
class AttentionSpec(Spec):
    """Names an attention kind and its static hyperparameters: ``AttentionSpec("block_sparse",
    {"pattern": Local(16, 0)})`` or ``AttentionSpec.from_config({"kind": "flash", "block_q":
    128})``; run by :class:`~xformers_jax.nn.MultiHeadAttention`."""

    kind: str = "dot_product"
    slot: ClassVar[str] = "attention"


@dataclasses.dataclass(frozen=True)
class MixerSpec(Spec):
    """Names a token mixer and its static hyperparameters, replacing a block's attention
    sublayer: ``MixerSpec("s4d", {"state_size": 64, "dt_min": 1e-3})`` or
    ``MixerSpec.from_config({"kind": "fnet"})``."""

    slot: ClassVar[str] = "mixer"

    def build(self, dim: int, num_heads: int, *, causal: bool, max_len: int, key):
        """The mixer module for a block of width ``dim``."""
        kind = self.record
        hp = kind.resolve(self.params)
        check_causal(kind, causal)
        return _build_layer(kind, dim, num_heads, hp, causal=causal, max_len=max_len, key=key)


def make_mixer(spec: MixerSpec, dim: int, num_heads: int, *, causal: bool, max_len: int, key):
    """The module of ``spec`` for a block of width ``dim``."""
    return spec.build(dim, num_heads, causal=causal, max_len=max_len, key=key)


@dataclasses.dataclass(frozen=True)
class FFNSpec(Spec):
    """Names an FFN kind and its hyperparameters: ``FFNSpec("switch", {"num_experts": 8})``,
    ``FFNSpec.from_config({"kind": "hash"})``; ``FFNSpec()`` is the dense FFN.

    ``every=n`` (a model's ``block``, or ``"every"`` in a config) puts the kind in every n-th
    layer and the dense FFN in the others (GLaM: ``every=2``); the models' stack builds that
    (``nn._cycle``), so a single block's spec has ``every=1``."""

    kind: str = "dense"
    every: int = 1
    slot: ClassVar[str] = "ffn"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"FFNSpec: every must be a positive integer, got {self.every!r}")

    @classmethod
    def from_config(cls, config: Mapping) -> "FFNSpec":
        config = dict(config)
        if "kind" not in config:
            raise ValueError(f"FFNSpec.from_config: missing 'kind' in {sorted(config)}")
        return cls(config.pop("kind"), config, every=int(config.pop("every", 1)))

    def build(self, dim: int, hidden: int, *, activation: str = "gelu", causal: bool = False,
              chunk_size: int | None = None, key):
        """The FFN layer for a block of width ``dim`` and inner width ``hidden``; a kind that
        declares ``chunk_size`` (the dense FFN) takes the block's unless the spec gives one."""
        if self.every != 1:
            raise ValueError(f"FFNSpec(every={self.every}) places {self.kind!r} in every "
                             f"{self.every}-th layer: give it to a model (block=dict(ffn=...)), "
                             "whose stack builds the cycle; a single block needs every=1")
        kind = self.record
        hp = kind.resolve(self.params)
        if chunk_size is not None and "chunk_size" in kind.hyperparameters \
                and "chunk_size" not in self.hyperparameters:
            hp["chunk_size"] = chunk_size
        check_causal(kind, causal)
        return _build_layer(kind, dim, hidden, hp, causal=causal, activation=activation,
                            key=key)


for _kind in (*attention.KINDS, *mixers.KINDS, *experts.KINDS):
    register_kind(_kind)
