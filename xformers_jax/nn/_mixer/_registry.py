"""The mixer registry: a block's token mixer named by a small spec, like its attention.

A :class:`MixerSpec` (``kind`` plus hyperparameters) is what configs hold
(``block=dict(mixer=MixerSpec("mamba2", {"state_size": 64}))``); it replaces the block's
attention sublayer. A :class:`MixerVariant` entry builds the Equinox module and carries the
kind's :class:`~xformers_jax.attention._kind.Kind` record (``metadata``: paper, cost, whether
it is causal-safe, needs a fixed length, and how it decodes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, final

import equinox as eqx
import jax
import jax.numpy as jnp

from ...attention._kind import Kind
from .._cache import RecurrentCache


@dataclasses.dataclass(frozen=True)
class MixerSpec:
    """Names a token mixer and its static hyperparameters (hashable, config friendly).

    Example: ``MixerSpec("s4d", {"state_size": 64, "dt_min": 1e-3, "dt_max": 1e-1})`` or
    ``MixerSpec.from_config({"kind": "fnet"})``.
    """

    kind: str
    params: Any = ()

    def __post_init__(self):
        items = self.params.items() if isinstance(self.params, Mapping) else self.params
        object.__setattr__(self, "params", tuple(sorted(dict(items).items())))
        get_mixer(self.kind)

    @property
    def hyperparameters(self) -> dict:
        return dict(self.params)

    @classmethod
    def from_config(cls, config: Mapping) -> "MixerSpec":
        """Builds a spec from a mapping with a ``kind`` key; every other key is a
        hyperparameter."""
        config = dict(config)
        if "kind" not in config:
            raise ValueError(f"MixerSpec.from_config: missing 'kind' in {sorted(config)}")
        kind = config.pop("kind")
        return cls(kind, config)


class MixerModule(eqx.Module):
    """What a block needs from a mixer: ``mixer(x [B, L, dim], kv_mask=bool[B, L] | None,
    positions=None, key=None) -> [B, L, dim]`` (zero at padded positions) and, for mixers
    that decode, ``init_cache(batch, max_len, dtype)`` and ``decode(x [B, 1, dim], cache) ->
    (y, cache)``. Mixers keep no ``eqx.nn.State`` (``state_index`` is None)."""

    state_index = None  # read by TransformerBlock like MultiHeadAttention's

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        raise NotImplementedError(f"{type(self).__name__} has no decoding cache (its mixer "
                                  "is not a recurrence)")

    def decode(self, x, cache):
        raise NotImplementedError(f"{type(self).__name__} cannot decode step by step")

    def sequence_problem(self) -> str | None:
        return (f"mixer {type(self).__name__} has no sequence-parallel form")


@final
@dataclasses.dataclass(frozen=True)
class MixerVariant:
    """One registered mixer.

    Attributes:
      name: the ``kind`` a spec uses.
      build: ``build(dim, num_heads, *, causal, max_len, key, **hp) -> MixerModule``.
      metadata: the kind's :class:`Kind` record (family ``"mixers"``): ``causal`` (a causal
        form exists), ``fixed_length`` (weights sized by ``max_len``), ``decoding``
        (``"recurrent"``: an O(1) state per step; None).
      hyperparameters: the names a spec may give.
    """

    name: str
    build: Callable
    metadata: Kind
    hyperparameters: frozenset = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "hyperparameters", frozenset(self.hyperparameters))
        if self.metadata.name != self.name:
            raise ValueError(f"MixerVariant {self.name!r}: its Kind record is named "
                             f"{self.metadata.name!r}")

    @property
    def causal(self) -> bool:
        return self.metadata.causal

    @property
    def fixed_length(self) -> bool:
        return self.metadata.fixed_length

    @property
    def decoding(self) -> str | None:
        return self.metadata.decoding

    def check(self, hp: Mapping, *, causal: bool):
        unknown = set(hp) - set(self.hyperparameters)
        if unknown:
            raise ValueError(f"mixer {self.name!r}: unknown hyperparameters {sorted(unknown)}; "
                             f"it accepts {sorted(self.hyperparameters)}")
        if causal and not self.causal:
            raise NotImplementedError(f"mixer {self.name!r} has no causal form (it mixes "
                                      "information from future positions)")

    def make(self, dim: int, num_heads: int, *, causal: bool, max_len: int, hp: Mapping, key):
        self.check(hp, causal=causal)
        return self.build(dim, num_heads, causal=causal, max_len=max_len, key=key, **hp)


_REGISTRY: dict[str, MixerVariant] = {}


def register_mixer(variant: MixerVariant, *, replace: bool = False) -> MixerVariant:
    """Adds a mixer; a name already registered raises ValueError unless ``replace=True``."""
    if variant.name in _REGISTRY and not replace:
        raise ValueError(f"mixer {variant.name!r} is already registered; pass replace=True")
    _REGISTRY[variant.name] = variant
    return variant


def get_mixer(name: str) -> MixerVariant:
    if name not in _REGISTRY:
        raise ValueError(f"unknown mixer {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def registered_mixers() -> tuple[str, ...]:
    """Names of every registered mixer."""
    return tuple(sorted(_REGISTRY))


def make_mixer(spec: MixerSpec, dim: int, num_heads: int, *, causal: bool, max_len: int, key):
    """The module of ``spec`` for a block of width ``dim``."""
    return get_mixer(spec.kind).make(dim, num_heads, causal=causal, max_len=max_len,
                                     hp=spec.hyperparameters, key=key)


# -- shared pieces of the mixer modules ---------------------------------------------------------

# Field names of state space parameters (discretisation steps, state matrices, input
# matrices): the optimizer gives them their own learning rate and no weight decay (Gu et al.
# 2022; Gu and Dao 2023 keep A_log, D and dt out of weight decay).
SSM_PARAMETERS = frozenset({"log_dt", "log_a_re", "a_im", "b_re", "b_im", "a_log", "dt_bias"})


def ssm_parameters(tree):
    """A tree of bools like ``tree``: True for the arrays of state space parameters (fields
    named in :data:`SSM_PARAMETERS`)."""
    def label(path, _):
        return any(isinstance(p, jax.tree_util.GetAttrKey) and p.name in SSM_PARAMETERS
                   for p in path)

    return jax.tree_util.tree_map_with_path(label, tree)


def dense(key, fan_in, fan_out):
    return jax.random.normal(key, (fan_in, fan_out)) / jnp.sqrt(fan_in)


def log_uniform(key, shape, low, high):
    """``log`` of step sizes drawn log-uniformly in ``[low, high]`` (S4's ``dt_min/dt_max``)."""
    if not 0 < low <= high:
        raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={low}, dt_max={high}")
    u = jax.random.uniform(key, shape)
    return jnp.log(low) + u * (jnp.log(high) - jnp.log(low))


def zero_padded(y, kv_mask):
    if kv_mask is None:
        return y
    return jnp.where(kv_mask[:, :, None], y, jnp.zeros((), y.dtype))


def check_mask(name, x, kv_mask):
    if x.ndim != 3:
        raise ValueError(f"{name}: x must be [B, L, dim], got shape {x.shape}")
    if kv_mask is not None and kv_mask.shape != x.shape[:2]:
        raise ValueError(f"{name}: kv_mask must be bool[B, L] = {list(x.shape[:2])}, got shape "
                         f"{kv_mask.shape}")


def both_ways(fn, arrays, kv_mask, causal):
    """``fn(*arrays, kv_mask)`` over one sequence, plus the same run from the last position
    when not causal (bidirectional forms: the backward pass's outputs flipped back)."""
    out = fn(*arrays, kv_mask)
    if causal:
        return out
    flip = lambda a: None if a is None else a[::-1]  # noqa: E731
    return out + flip(fn(*(flip(a) for a in arrays), flip(kv_mask)))


def recurrent_cache(state):
    return RecurrentCache(state, jnp.zeros((), jnp.int32))
