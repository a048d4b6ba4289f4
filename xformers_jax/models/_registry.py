"""The model registry: every whole model a config can name with ``model.kind``.

A :class:`ModelKind` says how one model is built from its config section (``model``: ``kind``
plus the keys the kind declares, with defaults), which task types it trains on, and what its
auxiliary outputs mean to a loss: the named terms it returns and their default weights.
Register one with :func:`register_model`, usually as a decorator on its builder::

    @register_model("my_lm", serves=("language_model",), defaults=dict(TRUNK, **SLOTS),
                    loss_weights={"my_penalty": 0.1})
    def my_lm(config, task, key):
        return MyLM(task.vocab_size, config.dim, ..., key=key)

The trainer knows no model family. It calls the model on a batch with ``return_aux=True`` and
gets ``(outputs, aux)``; :meth:`ModelKind.terms` turns ``aux`` into named scalar terms (a
mixture of experts' router losses summed over layers, ACT's ponder cost, the compressive
memory's reconstruction loss, PABEE's loss over the exits, ...); the trainer adds
``weight[name] * term[name]`` for every weight (the kind's defaults updated by the config's
``loss`` section; the task's own cross-entropy is the term ``cross_entropy``, weight 1 unless
the kind says otherwise) and logs every term (Levanter's pattern: the model returns its
auxiliary loss and the loss function adds it without knowing the model's kind).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Mapping, final

from ..nn import AttentionSpec, FFNSpec, MixerSpec, aux_terms

# The task types a model can serve (``train``'s tasks declare theirs): how a batch becomes the
# model's inputs and what its outputs are.
TASK_TYPES = ("classification", "pair_classification", "language_model",
              "stream_language_model", "self_supervised")
# The keys of the shared trunk (the sizes every Transformer model takes) and of its slots
# (open sections: ``kind`` plus that kind's hyperparameters).
TRUNK = dict(dim=512, num_layers=4, num_heads=8, hidden=1024)
SLOTS = dict(attention=dict(kind="dot_product"), mixer=dict(kind="none"), ffn=dict(kind="dense"))
# The task's own term (the mean cross-entropy of classification and language modelling).
TASK_TERM = "cross_entropy"


@final
@dataclasses.dataclass(frozen=True)
class ModelKind:
    """One registered model.

    Attributes:
      name: the ``model.kind`` a config names.
      build: ``build(config, task, key) -> eqx.Module``: ``config`` is the model section (a
        ``ConfigDict`` holding every key of ``defaults``, slots as sections), ``task`` the
        trainer's ``Task`` (``vocab_size``, ``num_classes``, ``seq_len``, ``padded``, splits).
      serves: the task types (:data:`TASK_TYPES`) it trains on.
      defaults: the keys of its config section with their defaults (a mapping value is an open
        section: ``kind`` plus that kind's hyperparameters, checked when the model is built).
      loss_weights: the default weight of each term it returns (``cross_entropy`` included
        when it is not 1); a config's ``loss`` section may name these and no others.
      target_terms: ``target_terms(aux, targets) -> {name: scalar}``: terms that need the
        targets (PABEE's weighted loss over every exit), or None.
      packs: the model takes packed rows (``segment_ids=`` int ``[B, L]``, several documents
        per row, each as if alone; ``data.pack=True`` of a language-model task); the
        trainer refuses packing for a kind that does not.
      logits_at: the model takes ``logits_at=`` int ``[B, K]`` (positions of each row) and
        returns the logits at those positions only, ``[B, K, vocab]``: the trainer then runs
        the output layer and the loss only where a task scores (``Task.num_scored``).
      doc: one line for listings (the builder's docstring's first line by default).
    """

    name: str
    build: Callable
    serves: tuple
    defaults: Mapping
    loss_weights: Mapping = dataclasses.field(default_factory=dict)
    target_terms: Callable | None = None
    doc: str = ""
    packs: bool = False
    logits_at: bool = False

    def __post_init__(self):
        object.__setattr__(self, "serves", tuple(self.serves))
        bad = [t for t in self.serves if t not in TASK_TYPES]
        if not self.serves or bad:
            raise ValueError(f"model kind {self.name!r}: serves must name task types of "
                             f"{TASK_TYPES}, got {self.serves}")
        if "kind" in self.defaults:
            raise ValueError(f"model kind {self.name!r}: 'kind' is not a default (it is the "
                             "section's name)")
        if not self.doc and self.build.__doc__:
            object.__setattr__(self, "doc", self.build.__doc__.strip().splitlines()[0])

    def weights(self, overrides: Mapping | None = None) -> dict:
        """The loss weights in effect: ``cross_entropy`` 1, this kind's defaults, then
        ``overrides`` (a config's ``loss`` section), each name checked."""
        out = {TASK_TERM: 1.0, **self.loss_weights}
        unknown = sorted(set(overrides or {}) - set(out))
        if unknown:
            raise ValueError(f"loss: {unknown} name no term of model kind {self.name!r} "
                             f"(its terms: {sorted(out)}){_did_you_mean(unknown[0], out)}")
        return {**out, **dict(overrides or {})}

    def terms(self, aux: Mapping, targets) -> dict:
        """The named scalar terms of ``aux`` (``nn.aux_terms``: the FFN slot's outputs
        reduced over layers, every other scalar entry as it is) and those of
        :attr:`target_terms`, which need the targets."""
        out = aux_terms(aux)
        if self.target_terms is not None:
            out.update(self.target_terms(aux, targets))
        return out


_MODELS: dict[str, ModelKind] = {}


def register_model(name: str, *, serves, defaults: Mapping, loss_weights: Mapping = (),
                   target_terms: Callable | None = None, packs: bool = False,
                   logits_at: bool = False, replace: bool = False):
    """A decorator registering ``build(config, task, key) -> model`` as the model kind
    ``name`` (see :class:`ModelKind` for the other arguments); a name already registered
    raises ValueError unless ``replace=True``. Returns the builder unchanged."""
    def register(build):
        kind = ModelKind(name, build, serves, dict(defaults), dict(loss_weights), target_terms,
                         packs=packs, logits_at=logits_at)
        if name in _MODELS and not replace:
            raise ValueError(f"model kind {name!r} is already registered; pass replace=True")
        _MODELS[name] = kind
        return build
    return register


def get_model(name: str) -> ModelKind:
    """The registered model kind ``name`` (ValueError listing the kinds otherwise)."""
    if name not in _MODELS:
        raise ValueError(f"unknown model kind {name!r}{_did_you_mean(name, _MODELS)}; "
                         f"registered: {sorted(_MODELS)}")
    return _MODELS[name]


def registered_models() -> tuple[str, ...]:
    """Names of every registered model kind."""
    return tuple(sorted(_MODELS))


def _did_you_mean(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def model_defaults(name: str) -> dict[str, Any]:
    """The model section of kind ``name`` with every default: ``{"kind": name, ...}``."""
    kind = get_model(name)
    return {"kind": name, **{k: dict(v) if isinstance(v, Mapping) else v
                             for k, v in kind.defaults.items()}}


def section(config, name: str, default: Mapping | None = None) -> dict:
    """The open section ``name`` of a model config (a ``ConfigDict`` or a mapping) as a plain
    dict (``default`` when the config has none)."""
    if name not in config:
        return dict(default or {})
    value = config[name]
    return value.to_dict() if hasattr(value, "to_dict") else dict(value)


def block_kwargs(config) -> dict:
    """The slot sections of a model config (``attention``, ``mixer``, ``ffn``) as
    ``nn.TransformerBlock`` keyword arguments (``spec``, ``mixer``, ``ffn``); a mixer of kind
    ``"none"`` leaves the attention in place."""
    block = dict(spec=AttentionSpec.from_config(section(config, "attention", SLOTS["attention"])),
                 ffn=FFNSpec.from_config(section(config, "ffn", SLOTS["ffn"])))
    mixer = section(config, "mixer", SLOTS["mixer"])
    if mixer["kind"] != "none":
        block["mixer"] = MixerSpec.from_config(mixer)
    return block
