"""What each attention kind is, as data declared beside its function.

Every family keeps one ``_kinds.py`` (``attention/_kinds.py`` for the exact kinds) with a
:class:`Kind` per kind: its function, family, paper, cost, what it supports and tiny test
hyperparameters. ``xformers_jax.nn`` builds its registry from these records and
``experiments/catalogue.py`` writes ``CATALOGUE.md`` from them; nothing here imports ``nn``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, ClassVar, Mapping

# The decoding modes a kind can declare (``None``: it cannot decode step by step).
DECODING = ("kv", "window", "recurrent")
FAMILIES = ("exact", "sparse", "linear", "lowrank", "learned", "priors", "mixers")


@dataclasses.dataclass(frozen=True)
class Paper:
    """The paper that introduced a kind: ``authors`` as cited (``"Wang et al."``)."""

    authors: str
    year: int
    title: str

    def __str__(self):
        return f"{self.authors} ({self.year}), {self.title}"


@dataclasses.dataclass(frozen=True)
class Kind:
    """Metadata of one attention kind.

    Attributes:
      name: the ``kind`` an ``AttentionSpec`` uses.
      function: the one-sequence one-head function of the contract that computes it.
      family: one of :data:`FAMILIES`.
      paper: where it comes from.
      time, memory: complexity in the sequence length ``L`` (and the kind's own sizes).
      causal: whether ``causal=True`` is supported.
      decoding: ``"kv"`` (a growing key/value cache), ``"window"`` (a ring buffer of the last
        keys), ``"recurrent"`` (a fixed-size state) or None (cannot decode; the default).
      bias: whether additive score biases (ALiBi, T5, ...) are supported (default no).
      fixed_length: whether its parameters are sized by the maximum length (sequences up to
        ``max_len`` only; Linformer's projections, the Synthesizer's dense logits, ...).
      test_hyperparameters: what the kind needs at the tiny test size (``L = max_len = 16``,
        head width 8), as sorted ``(name, value)`` pairs (pass a mapping).
    """

    name: str
    function: Callable
    family: str
    paper: Paper
    time: str
    memory: str
    causal: bool
    decoding: str | None = None
    bias: bool = False
    fixed_length: bool = False
    test_hyperparameters: Any = ()
    # The families and decoding modes this record accepts; a record type for another slot
    # subclasses Kind with its own (nn's FFN kinds: ``nn.FFNKind``).
    families: ClassVar[tuple[str, ...]] = FAMILIES
    decodings: ClassVar[tuple[str, ...]] = DECODING

    def __post_init__(self):
        hp = self.test_hyperparameters
        items = hp.items() if isinstance(hp, Mapping) else hp
        object.__setattr__(self, "test_hyperparameters", tuple(sorted(dict(items).items())))
        what = type(self).__name__
        if self.family not in self.families:
            raise ValueError(f"{what} {self.name!r}: family must be one of {self.families}, got "
                             f"{self.family!r}")
        if self.decoding not in (*self.decodings, None):
            raise ValueError(f"{what} {self.name!r}: decoding must be one of {self.decodings} or "
                             f"None, got {self.decoding!r}")

    @property
    def hyperparameters(self) -> dict:
        """The tiny test hyperparameters as a dict."""
        return dict(self.test_hyperparameters)

    def missing(self) -> tuple[str, ...]:
        """Names of the fields left empty (a complete record returns ``()``)."""
        empty = [f.name for f in dataclasses.fields(self)
                 if f.name != "test_hyperparameters" and getattr(self, f.name) in ("", None)
                 and f.name != "decoding"]
        if not callable(self.function):
            empty.append("function")
        p = self.paper
        if not (isinstance(p, Paper) and p.authors and p.title and p.year > 1900):
            empty.append("paper")
        return tuple(empty)


_FAMILY_MODULES = ("._kinds", ".sparse._kinds", ".linear._kinds", ".lowrank._kinds",
                   ".learned._kinds", ".priors._kinds")


def all_kinds() -> tuple[Kind, ...]:
    """Every kind declared by the attention families, in family order."""
    out = []
    for name in _FAMILY_MODULES:
        out.extend(importlib.import_module(name, __package__).KINDS)
    return tuple(out)
