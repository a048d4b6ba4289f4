"""The feed-forward slot of a block: a registry of FFN kinds, named by :class:`FFNSpec`.

``TransformerBlock(..., ffn=FFNSpec("switch", {"num_experts": 8}))`` (or through models,
``block=dict(ffn=FFNSpec(...))``) builds the registered kind in place of the dense
:class:`FeedForward`, which stays the default (``FFNSpec()``, kind ``"dense"``).

**The FFN call contract.** Every registered FFN module is called
``ffn(x [B, L, dim], *, mask=None, tokens=None, key=None, inference=False) -> (y, aux)``:
``mask bool[B, L]`` (False for padding), ``tokens int[B, L]`` (hash routing reads token ids),
``key`` (router jitter, GShard's random second choice, Gumbel noise; None in evaluation).
``aux`` is a dict of arrays, the same keys for every call of one kind (``{}`` for the dense
FFN); the MoE kinds return :data:`MOE_AUX` keys: ``load_balancing`` and ``router_z`` (the
losses of ``xformers_jax.experts``, scalars), ``dropped_fraction`` (scalar) and
``expert_load`` (``float32[E]``).

**How auxiliary outputs leave the model.** A block called with ``return_aux=True`` returns its
FFN's ``aux`` beside its usual result; ``LayerStack`` always asks its blocks for it and stacks
it as a ``lax.scan`` output (a leading layer axis), and returns it with ``return_aux=True``;
models pass ``return_aux`` through and return ``(logits, aux)``. :func:`aux_losses` sums each
loss over layers (each layer's loss from its own router) and the trainer adds them to the
cross-entropy with the config's coefficients (``config.loss``) and logs them with the
statistics (:func:`aux_metrics`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import jax.numpy as jnp

from ..attention._kind import Kind, Paper
from ..experts import LOAD_BALANCING_COEF, Z_LOSS_COEF
from ._ffn import FeedForward

FFN_FAMILIES = ("dense", "experts", "capacity")
FFN_DECODING = ("token",)
MOE_AUX = ("load_balancing", "router_z", "dropped_fraction", "expert_load")
AUX_LOSSES = ("load_balancing", "router_z")


@dataclasses.dataclass(frozen=True)
class FFNKind(Kind):
    """Metadata of one FFN kind: ``attention._kind.Kind``'s record and checks with the FFN
    families (:data:`FFN_FAMILIES`) and decoding modes (``"token"``: runs on one new token at a
    time, the default; None: cannot decode).

    Attributes:
      name: the ``kind`` of an :class:`FFNSpec`. function: the pure function computing it.
      family: one of :data:`FFN_FAMILIES`. paper: a ``Paper``. time, memory: cost per token.
      causal: usable in a causal model (the output of a token depends on no later token).
      decoding: ``"token"`` or None. fixed_length: parameters sized by the sequence length.
      test_hyperparameters: what the kind needs at the tiny test size (dim 16, hidden 32),
        sorted ``(name, value)`` pairs.
    """

    decoding: str | None = "token"
    families: ClassVar[tuple[str, ...]] = FFN_FAMILIES
    decodings: ClassVar[tuple[str, ...]] = FFN_DECODING


@dataclasses.dataclass(frozen=True)
class FFNVariant:
    """A registered FFN kind: ``metadata`` and ``build(dim, hidden, *, activation, causal,
    key, **hyperparameters) -> module`` following the FFN call contract."""

    metadata: FFNKind
    build: Callable

    @property
    def name(self) -> str:
        return self.metadata.name


_FFNS: dict[str, FFNVariant] = {}


def register_ffn(metadata: FFNKind, build: Callable, *, replace: bool = False) -> FFNVariant:
    if metadata.name in _FFNS and not replace:
        raise ValueError(f"FFN kind {metadata.name!r} is already registered")
    _FFNS[metadata.name] = FFNVariant(metadata, build)
    return _FFNS[metadata.name]


def get_ffn(name: str) -> FFNVariant:
    if name not in _FFNS:
        raise ValueError(f"unknown FFN kind {name!r}; registered: {sorted(_FFNS)}")
    return _FFNS[name]


def registered_ffns() -> tuple[str, ...]:
    return tuple(_FFNS)


@dataclasses.dataclass(frozen=True)
class FFNSpec:
    """Names an FFN kind and its hyperparameters (hashable, config friendly):
    ``FFNSpec("switch", {"num_experts": 8})``, ``FFNSpec.from_config({"kind": "hash"})``.

    ``every=n`` (a model's ``block``, or ``"every"`` in a config) puts the kind in every n-th
    layer and the dense FFN in the others (GLaM: ``every=2``); the models' stack builds that
    (:mod:`._cycle`), so a single block's spec has ``every=1``."""

    kind: str = "dense"
    params: Any = ()
    every: int = 1

    def __post_init__(self):
        items = self.params.items() if isinstance(self.params, Mapping) else self.params
        object.__setattr__(self, "params", tuple(sorted(dict(items).items())))
        get_ffn(self.kind)
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"FFNSpec: every must be a positive integer, got {self.every!r}")

    @property
    def hyperparameters(self) -> dict:
        return dict(self.params)

    @classmethod
    def from_config(cls, config: Mapping) -> "FFNSpec":
        config = dict(config)
        if "kind" not in config:
            raise ValueError(f"FFNSpec.from_config: missing 'kind' in {sorted(config)}")
        return cls(config.pop("kind"), config, every=int(config.pop("every", 1)))

    def build(self, dim: int, hidden: int, *, activation: str = "gelu", causal: bool = False,
              chunk_size: int | None = None, key):
        if self.every != 1:
            raise ValueError(f"FFNSpec(every={self.every}) places {self.kind!r} in every "
                             f"{self.every}-th layer: give it to a model (block=dict(ffn=...)), "
                             "whose stack builds the cycle; a single block needs every=1")
        hp = self.hyperparameters
        if self.kind == "dense":
            return FeedForward(dim, hidden, activation, chunk_size=chunk_size, key=key, **hp)
        variant = get_ffn(self.kind)
        if causal and not variant.metadata.causal:
            raise ValueError(f"FFN kind {self.kind!r} is not causal-safe (a token's output "
                             f"would depend on later tokens); use it in a bidirectional model")
        return variant.build(dim, hidden, activation=activation, causal=causal, key=key, **hp)


def call_ffn(ffn, x, *, mask=None, tokens=None, key=None, inference=False):
    """Calls an FFN by the contract: ``(y, aux)`` (the dense ``FeedForward`` gives ``{}``)."""
    if isinstance(ffn, FeedForward):
        return ffn(x), {}
    return ffn(x, mask=mask, tokens=tokens, key=key, inference=inference)


def aux_losses(aux: Mapping) -> dict:
    """The auxiliary losses of a model's ``aux`` (leading layer axis), each summed over
    layers; absent ones are 0."""
    return {name: jnp.sum(aux[name]) if name in aux else jnp.zeros(())
            for name in AUX_LOSSES}


def aux_metrics(aux: Mapping) -> dict:
    """Scalars to log: the summed losses, the mean dropped fraction over layers and the
    largest expert load relative to uniform (1 at perfect balance, ``E`` if one expert takes
    everything), averaged over layers."""
    out = {}
    if "load_balancing" in aux:
        out.update({f"aux_{k}": v for k, v in aux_losses(aux).items()})
    if "dropped_fraction" in aux:
        out["tokens_dropped"] = jnp.mean(aux["dropped_fraction"])
    if "expert_load" in aux:
        load = aux["expert_load"]
        out["max_expert_load"] = jnp.mean(load.max(-1) * load.shape[-1])
    return out


# The default weights of the FFN slot's loss terms in a training loss (Switch's load
# balancing, ST-MoE's router z-loss): model kinds declare them with their own terms.
AUX_WEIGHTS = {"load_balancing": LOAD_BALANCING_COEF, "router_z": Z_LOSS_COEF}


def aux_terms(aux: Mapping) -> dict:
    """The FFN slot's outputs in a model's ``aux`` (leading layer axis) as named scalars for a
    loss and a log: ``load_balancing`` and ``router_z`` summed over layers (each layer's loss
    from its own router), ``tokens_dropped`` (the mean dropped fraction over layers) and
    ``max_expert_load`` (the largest expert load relative to uniform, averaged over layers: 1
    at perfect balance, ``E`` if one expert takes everything). Empty without MoE layers."""
    out = {}
    if "load_balancing" in aux:
        out.update(aux_losses(aux))
    if "dropped_fraction" in aux:
        out["tokens_dropped"] = jnp.mean(aux["dropped_fraction"])
    if "expert_load" in aux:
        load = aux["expert_load"]
        out["max_expert_load"] = jnp.mean(load.max(-1) * load.shape[-1])
    return out


register_ffn(FFNKind(
    "dense", FeedForward, "dense",
    Paper("Vaswani et al.", 2017, "Attention Is All You Need"),
    time="O(dim * hidden)", memory="O(hidden)", causal=True), FeedForward)
