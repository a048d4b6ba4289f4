"""What a kind is, as data: the one record type of every slot a block fills by name.

A *kind* is one named way to fill a slot of a block: an attention kind (``"flash"``,
``"performer"``), a token mixer (``"mamba2"``) or an FFN kind (``"switch"``). Each is declared
once, as a :class:`Kind`, beside the function that computes it (``attention/**/_kinds.py``,
``mixers/_kinds.py``, ``experts/_kinds.py``): its family (from which its slot follows), paper,
cost, what it supports, every hyperparameter a spec may give (with its default and a one-line
doc), tiny test hyperparameters, and its adapter, i.e. how a layer runs it
(:class:`AttentionAdapter` for an attention kind; for a mixer or an FFN kind, the layer class
that ``xformers_jax.nn`` attaches with ``nn.implements``).

``xformers_jax.nn`` keeps the one registry (``nn.register_kind``, ``nn.get_kind``,
``nn.registered_kinds``) and names a kind with a spec (``nn.AttentionSpec``, ``nn.MixerSpec``,
``nn.FFNSpec``); ``experiments/catalogue.py`` writes ``CATALOGUE.md`` from the records. This
module imports nothing of the project, so every layer may declare kinds.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from typing import Any, Callable, Mapping, NamedTuple, final

# The slots a block fills by name, each with its families (the slot of a kind follows from its
# family) and the decoding modes its kinds may declare (None: cannot decode step by step).
SLOTS = ("attention", "mixer", "ffn")
FAMILIES = {
    "attention": ("exact", "sparse", "linear", "lowrank", "learned", "priors", "modern"),
    "mixer": ("mixers",),
    "ffn": ("dense", "experts", "capacity"),
}
DECODINGS = {
    # kv: a growing key/value cache; window: a ring buffer of the last keys; recurrent: a
    # fixed-size state.
    "attention": ("kv", "window", "recurrent"),
    # kv: a cache growing with the sequence (gMLP's past gate inputs); recurrent: O(1) state.
    "mixer": ("kv", "recurrent"),
    # token: runs on one new token at a time.
    "ffn": ("token",),
}
# How messages name a kind of each slot ("unknown mixer 'x'", "FFN kind 'x' ...").
NOUNS = {"attention": "attention kind", "mixer": "mixer", "ffn": "FFN kind"}
_SLOT_OF = {family: slot for slot, families in FAMILIES.items() for family in families}


@dataclasses.dataclass(frozen=True)
class Paper:
    """The paper that introduced a kind: ``authors`` as cited (``"Wang et al."``)."""

    authors: str
    year: int
    title: str

    def __str__(self):
        return f"{self.authors} ({self.year}), {self.title}"


@final
class _Required:
    """The default of a hyperparameter a spec must give."""

    def __repr__(self):
        return "REQUIRED"

    def __reduce__(self):
        return "REQUIRED"


REQUIRED = _Required()


class Hyperparameter(NamedTuple):
    """One hyperparameter a spec may give: its ``default`` (:data:`REQUIRED` when a spec must
    give it) and a one-line ``doc``. A kind may declare one as a ``(default, doc)`` tuple."""

    default: Any
    doc: str

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


# -- the attention adapter: how MultiHeadAttention runs a kind ---------------------------------

@final
@dataclasses.dataclass(frozen=True)
class KVDecoding:
    """Decodes with a growing key/value cache and exact softmax over it.

    ``pattern(hp)`` gives the causal-safe sparse pattern whose row ``t`` masks the cache at step
    ``t`` (None, or a ``pattern`` returning None, for dense attention).

    A kind whose attention over the cache is not plain softmax (two maps, a data-dependent
    selection of cached blocks) or whose cache holds something other than the layer's keys and
    values (a compressed latent) gives the three hooks below; each receives the
    hyperparameters (without ``init_only`` ones) as keywords.

    - ``attend(q [B,1,H,Dk], k [B,C,Hc,Dc], v [B,C,Hc,Ec], params, *, valid bool[B,C],
      index, **hp) -> [B,1,H,Dv]``: the new query (at position ``index - 1``) over the cache,
      whose slot ``s`` holds position ``s`` (``valid`` marks the filled slots); a kind whose
      adapter ``takes_input`` also receives ``inputs [B,1,dim]``;
    - ``entry(inputs [B,1,dim], k [B,1,Hkv,Dk], v [B,1,Hkv,Dv], params, *, position,
      **hp) -> (k_entry [B,1,Hc,Dc], v_entry [B,1,Hc,Ec])``: what one token appends to the
      cache (default: its keys and values);
    - ``widths(hp, *, num_heads, num_kv_heads, head_dim) -> (Hc, Dc, Ec)``: the cache's
      per-token shape (default ``(num_kv_heads, head_dim, head_dim)``); ``num_heads`` (the
      query heads) sizes what a kind keeps per query head (forgetting attention's gates).

    A kind whose cached keys change as the sequence grows (PaTH: every cached key is
    transformed by each new token's Householder) gives ``update(k [B,C,Hc,Dc], params, *,
    inputs [B,1,dim], valid bool[B,C], index, **hp) -> k``: the cached keys rewritten before
    the new token's entry is appended at ``index`` (it works with or without ``attend``).
    """

    pattern: Callable[[Mapping], Any] | None = None
    attend: Callable | None = None
    entry: Callable | None = None
    widths: Callable | None = None
    update: Callable | None = None
    name = "kv"

    def __post_init__(self):
        if self.attend is None and (self.entry is not None or self.widths is not None):
            raise ValueError("KVDecoding: a cache of its own (entry, widths) needs the attend "
                             "that reads it")

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

    ``attend`` has :class:`AttentionAdapter`'s ``attend`` signature and computes the same
    function with ``length`` sharded (ring attention, the halo exchange, the sequence-parallel
    scan: each lives with its family in :mod:`xformers_jax.attention`). ``check(hp, causal)``
    returns None when these hyperparameters can run sharded, or the reason they cannot.
    """

    attend: Callable
    check: Callable[[Mapping, bool], str | None] = lambda hp, causal: None


def _no_params(key, hp, *, num_heads, head_dim, max_len):
    return None


@final
@dataclasses.dataclass(frozen=True)
class AttentionAdapter:
    """How ``nn.MultiHeadAttention`` runs one attention kind, on ``[batch, length, heads, dim]``
    arrays. Every callable receives the spec's hyperparameters with every default filled
    (``Kind.resolve``).

    Attributes:
      attend: ``attend(q [B,Lq,H,Dk], k [B,Lk,Hkv,Dk], v [B,Lk,Hkv,Dv], params, *, causal,
        kv_mask [B,Lk] | None, bias, key, q_mask [B,Lq] | None = None, **hp) -> [B,Lq,H,Dv]``;
        ``bias`` is a pytree callable whose leaves lead with ``[B, H]`` (see
        ``nn._positions``) or None. ``q_mask`` marks the real queries (the padding mask in
        self-attention): a kind that computes statistics over queries must keep the others
        out of them (the contract, :mod:`xformers_jax.attention._contract`); the module zeros
        their outputs. It never sees the ``init_only`` hyperparameters.
      init: ``init(key, hp, *, num_heads, head_dim, max_len) -> pytree | None``: the kind's
        own trainable arrays (e.g. Linformer's projections); it sees every hyperparameter.
      decoding: a :class:`KVDecoding`, :class:`WindowDecoding`, :class:`RecurrentDecoding`, or
        None (cannot decode); it must match the record's ``decoding`` mode.
      init_only: the hyperparameters that only shape the parameters (Linformer's
        ``proj_len``): ``init`` reads them, ``attend`` and decoding never see them.
      takes_input: ``attend`` also receives ``inputs`` (the block input ``[B, L, dim]``) and
        ``init`` receives ``dim`` and ``num_kv_heads`` (e.g. Longformer's global projections;
        PaTH's transforms, one per key/value head).
      state: ``state(key, hp, *, num_heads, head_dim) -> pytree`` or None: the initial value of
        the kind's non-gradient state (an ``eqx.nn.StateIndex`` of the module). ``attend``
        then also receives ``state`` (the current value) and ``inference`` and returns
        ``(out, new_state)``.
      layer_carry: ``layer_carry(batch, lq, lk, hp, *, num_heads, head_dim, num_layers) ->
        pytree`` or None: for kinds that pass scores from one layer to the next (Realformer,
        Predictive attention, Lazyformer), the first layer's carry; ``attend`` then also
        receives ``carry`` and returns ``(out, new_carry)``, and ``nn.LayerStack`` threads it
        through its layers.
      dense_scores: the kind needs the previous layer's ``[Lq, Lk]`` attention map itself
        (Predictive attention, Lazyformer), which no tiled kernel forms.
      sequence: a :class:`SequenceParallel` when the kind can run with ``length`` split over
        devices (the ``sequence`` strategy), else None.
      aux: the names of the auxiliary losses the kind reports (DeepSeek sparse attention's
        ``indexer_kl``, which trains its lightning indexer). ``attend`` then also receives
        ``return_aux``, True in a training call whose caller takes auxiliary outputs (a
        ``Carry`` given, ``inference`` False), and then returns ``(out, {name: float32
        scalar})`` with these names; the layer writes them into ``carry.aux`` beside the FFN
        slot's (``nn._ffns``).
    """

    attend: Callable
    init: Callable = _no_params
    decoding: Decoding | None = None
    init_only: frozenset = frozenset()
    takes_input: bool = False
    state: Callable | None = None
    layer_carry: Callable | None = None
    dense_scores: bool = False
    sequence: SequenceParallel | None = None
    aux: tuple = ()

    def __init_subclass__(cls, **kwargs):
        raise TypeError("AttentionAdapter is final: give a kind its module-side needs with the "
                        "fields takes_input, state, layer_carry and decoding, not with a subclass")

    def __post_init__(self):
        object.__setattr__(self, "init_only", frozenset(self.init_only))
        object.__setattr__(self, "aux", tuple(self.aux))
        if self.state is not None and self.layer_carry is not None:
            raise ValueError("AttentionAdapter: a kind keeps eqx.nn.State or a carry between "
                             "layers, not both")
        if self.aux and (self.state is not None or self.layer_carry is not None):
            raise ValueError(f"AttentionAdapter: a kind reporting auxiliary losses {self.aux} "
                             "keeps no eqx.nn.State and no carry between layers (attend returns "
                             "one second value)")
        if self.decoding is not None and not isinstance(
                self.decoding, (KVDecoding, WindowDecoding, RecurrentDecoding)):
            raise ValueError("AttentionAdapter: decoding must be a KVDecoding, WindowDecoding, "
                             f"RecurrentDecoding or None, got {self.decoding!r}")

    def call_hyperparameters(self, hp: Mapping) -> dict:
        """``hp`` without the ``init_only`` names: what ``attend`` and decoding receive."""
        return {n: val for n, val in hp.items() if n not in self.init_only}


# -- the record ----------------------------------------------------------------------------------

@final
@dataclasses.dataclass(frozen=True, eq=False)
class Kind:
    """One kind of one slot: what it is, what it accepts, and how a layer runs it.

    Attributes:
      name: the ``kind`` a spec uses.
      function: the pure function that computes it (attention: the one-sequence one-head
        function of the contract).
      family: one of :data:`FAMILIES` of its slot; the slot follows (:attr:`slot`).
      paper: where it comes from (a :class:`Paper`).
      time, memory: complexity in the sequence length ``L`` (and the kind's own sizes); FFN
        kinds: per token.
      causal: whether it is usable in a causal model (attention: ``causal=True`` is supported;
        a mixer has a causal form; an FFN kind's output for a token depends on no later token).
      decoding: one of :data:`DECODINGS` of its slot, or None (cannot decode step by step;
        the default).
      bias: whether additive score biases (ALiBi, T5, ...) are supported (default no).
      mixes_rows: whether one batch row's outputs depend on the other rows by design (expert
        choice routing picks tokens over the whole batch); such a kind cannot be causal (a
        row's later tokens would reach another row's earlier outputs) and is refused in causal
        models. Every other kind keeps the rows of a batch independent.
      fixed_length: whether its parameters are sized by the maximum length (sequences up to
        ``max_len`` only; Linformer's projections, the Synthesizer's dense logits, ...).
      segments: whether the kind honours segment ids, i.e. runs packed rows (several
        documents in one row, ``segment_ids int[B, L]``, 0 for padding) with each document's
        outputs equal to that document run alone: no attention across documents (attention
        kinds: the adapter's ``attend`` then takes ``segment_ids``), no recurrence or
        convolution across a boundary (mixers), nothing shared between tokens (FFN kinds).
        ``True``, ``False`` (the default: packing is refused naming the kind), a string (packing
        is refused with this reason: why the method cannot keep documents apart exactly), or a
        callable ``hp -> None | reason`` for kinds that honour them for some hyperparameters
        only (capacity dispatch shares expert slots between the documents of a row). See
        :meth:`segment_problem`.
      state_size: what decoding keeps, in numbers per layer and sequence: for a recurrence its
        fixed state (``"H D_k D_v"``: a ``[D_k, D_v]`` matrix per head), for a cache what
        each token adds; ``""`` when not declared.
      test_hyperparameters: what the kind needs at the tiny test size (attention: ``L =
        max_len = 16``, head width 8; mixers: width 16, two heads; FFN kinds: dim 16, hidden
        32), as sorted ``(name, value)`` pairs (pass a mapping).
      hyperparameters: every name a spec may give, mapped to its :class:`Hyperparameter`
        (default or :data:`REQUIRED`, and a one-line doc); pass ``(default, doc)`` tuples.
      layer_arguments: fixed keyword arguments a mixer or FFN kind gives its layer (the MoE
        kinds' ``router``); a spec cannot give them.
      adapter: how a layer runs the kind: an :class:`AttentionAdapter` for an attention kind;
        the layer class for a mixer or FFN kind (attached in ``xformers_jax.nn``), built as
        ``layer(dim, num_heads | hidden, *, causal, max_len | activation, key,
        **layer_arguments, **hyperparameters)``. None: not runnable yet.
    """

    name: str
    function: Callable
    family: str
    paper: Paper | None
    time: str
    memory: str
    causal: bool
    decoding: str | None = None
    bias: bool = False
    mixes_rows: bool = False
    fixed_length: bool = False
    segments: bool | str | Callable[[Mapping], str | None] = False
    state_size: str = ""
    test_hyperparameters: Any = ()
    hyperparameters: Mapping[str, Hyperparameter] = dataclasses.field(default_factory=dict)
    layer_arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    adapter: Any = None

    def __init_subclass__(cls, **kwargs):
        raise TypeError("Kind is final: kinds of every slot are one record type; give a kind "
                        "its slot with its family, its needs with hyperparameters, "
                        "layer_arguments and adapter, not with a subclass")

    def __post_init__(self):
        hp = self.test_hyperparameters
        items = hp.items() if isinstance(hp, Mapping) else hp
        object.__setattr__(self, "test_hyperparameters", tuple(sorted(dict(items).items())))
        if self.family not in _SLOT_OF:
            raise ValueError(f"Kind {self.name!r}: family must be one of {tuple(_SLOT_OF)}, got "
                             f"{self.family!r}")
        declared = {}
        for n, h in dict(self.hyperparameters).items():
            h = Hyperparameter(*h)
            if not (isinstance(h.doc, str) and h.doc):
                raise ValueError(f"Kind {self.name!r}: hyperparameter {n!r} needs a one-line doc")
            declared[n] = h
        object.__setattr__(self, "hyperparameters", types.MappingProxyType(declared))
        object.__setattr__(self, "layer_arguments",
                           types.MappingProxyType(dict(self.layer_arguments)))
        if self.mixes_rows and self.causal:
            raise ValueError(f"Kind {self.name!r} mixes batch rows, so it cannot claim causal "
                             "support: a token of one row would reach earlier outputs of another")
        modes = DECODINGS[self.slot]
        if self.decoding not in (*modes, None):
            raise ValueError(f"Kind {self.name!r}: decoding must be one of {modes} or None, got "
                             f"{self.decoding!r}")
        fixed = sorted(set(self.layer_arguments) & set(declared))
        if fixed:
            raise ValueError(f"Kind {self.name!r}: {fixed} are fixed layer_arguments, so not "
                             "hyperparameters a spec may give")
        if self.slot == "attention":
            self._check_attention_adapter()
        elif self.adapter is not None and not callable(self.adapter):
            raise ValueError(f"Kind {self.name!r}: the adapter of a {NOUNS[self.slot]} is its "
                             f"layer class, got {self.adapter!r}")

    def _check_attention_adapter(self):
        if self.layer_arguments:
            raise ValueError(f"Kind {self.name!r}: an attention kind gives its arguments through "
                             "its AttentionAdapter, not layer_arguments")
        a = self.adapter
        if a is None:
            return
        if not isinstance(a, AttentionAdapter):
            raise ValueError(f"Kind {self.name!r}: an attention kind's adapter is an "
                             f"AttentionAdapter, got {a!r}")
        if not a.init_only <= set(self.hyperparameters):
            raise ValueError(f"Kind {self.name!r}: init_only {sorted(a.init_only)} must be among "
                             f"its hyperparameters {sorted(self.hyperparameters)}")
        mode = None if a.decoding is None else a.decoding.name
        if mode != self.decoding:
            raise ValueError(f"Kind {self.name!r}: its adapter decodes with {mode!r} but the "
                             f"record declares decoding={self.decoding!r}")

    @property
    def slot(self) -> str:
        """``"attention"``, ``"mixer"`` or ``"ffn"`` (from the family)."""
        return _SLOT_OF[self.family]

    def missing(self) -> tuple[str, ...]:
        """Names of the descriptive fields left empty (a complete record returns ``()``)."""
        empty = [f for f in ("name", "function", "family", "paper", "time", "memory", "causal")
                 if getattr(self, f) in ("", None)]
        if not callable(self.function) and "function" not in empty:
            empty.append("function")
        p = self.paper
        if not (isinstance(p, Paper) and p.authors and p.title and p.year > 1900) \
                and "paper" not in empty:
            empty.append("paper")
        return tuple(empty)

    def segment_problem(self, hp: Mapping) -> str | None:
        """None when this kind with (resolved) hyperparameters ``hp`` honours segment ids
        (:attr:`segments`: packed rows, each document as if alone), else why not, naming the
        kind."""
        if self.segments is True:
            return None
        if self.segments is False:
            return (f"{NOUNS[self.slot]} {self.name!r} does not honour segment ids (packed "
                    "documents would see each other through it); train it on unpacked rows "
                    "(data.pack=False)")
        if isinstance(self.segments, str):
            return (f"{NOUNS[self.slot]} {self.name!r} does not honour segment ids: "
                    f"{self.segments}; train it on unpacked rows (data.pack=False)")
        reason = self.segments(hp)
        return None if reason is None else f"{NOUNS[self.slot]} {self.name!r}: {reason}"

    def check_names(self, params: Mapping | Any) -> None:
        """Raises ``ValueError`` if ``params`` (a mapping or ``(name, value)`` pairs) names a
        hyperparameter this kind does not declare, listing the accepted names and the closest
        one to each unknown name."""
        given = dict(params.items() if isinstance(params, Mapping) else params)
        unknown = sorted(set(given) - set(self.hyperparameters))
        if not unknown:
            return
        hints = [f"{close[0]!r} for {n!r}" for n in unknown
                 if (close := difflib.get_close_matches(n, list(self.hyperparameters), n=1))]
        raise ValueError(
            f"{NOUNS[self.slot]} {self.name!r}: unknown hyperparameters {unknown}; it accepts "
            f"{sorted(self.hyperparameters)}"
            + (f" (did you mean {', '.join(hints)}?)" if hints else ""))

    def resolve(self, params: Mapping | Any) -> dict:
        """``params`` (a mapping or ``(name, value)`` pairs) with every declared default filled
        in: what the kind's adapter or layer receives. Raises ``ValueError`` for an unknown
        name (see :meth:`check_names`) or a missing :data:`REQUIRED` one (naming it and its
        doc)."""
        given = dict(params.items() if isinstance(params, Mapping) else params)
        self.check_names(given)
        missing = [f"{n!r} ({h.doc})" for n, h in self.hyperparameters.items()
                   if h.required and n not in given]
        if missing:
            raise ValueError(f"{NOUNS[self.slot]} {self.name!r}: missing required "
                             f"hyperparameters: {'; '.join(missing)}")
        return {**{n: h.default for n, h in self.hyperparameters.items() if not h.required},
                **given}
